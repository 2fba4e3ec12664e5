// torch.distributed's Python process groups handed to the C++ engine.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace roundpipe::python {

// The c10d process group behind `boxed`, what a Python ProcessGroup's
// boxed() returns (a TorchScript object: torch's own converter unwraps it,
// so this extension need not share pybind11's type registry with torch's).
c10::intrusive_ptr<c10d::ProcessGroup> process_group_from(pybind11::handle boxed);

}  // namespace roundpipe::python

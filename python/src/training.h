// roundpipe._C's training stack: data, schedules, metrics (training.cpp).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace roundpipe::python {

namespace py = pybind11;

void bind_training(py::module_& m);

}  // namespace roundpipe::python

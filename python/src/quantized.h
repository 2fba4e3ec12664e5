// roundpipe._C's 4-bit weight formats (quantized.cpp).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace roundpipe::python {

namespace py = pybind11;

void bind_quantized(py::module_& m);

}  // namespace roundpipe::python

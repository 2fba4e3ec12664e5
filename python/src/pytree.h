// Python values <-> c10::IValue trees, so Python layers, inputs, labels and
// outputs travel through the C++ engine.
//
//   torch.Tensor            <-> Tensor (the same tensor, no copy)
//   None/bool/int/float/str <-> the IValue scalar
//   tuple, list, dict[str]  <-> Tuple, List, Dict (split/merge look inside)
//   other pytree nodes      <-> Tuple(node kind, children...), where the node
//     (namedtuple, OrderedDict, HuggingFace ModelOutput, ...; anything
//     torch.utils._pytree knows) kind is an opaque capsule; the engine sees
//     and splits the children.
//   anything else           <-> an opaque capsule holding the object,
//     replicated across microbatches and compared with == on merge.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

namespace roundpipe::python {

namespace py = pybind11;

c10::IValue to_ivalue(py::handle obj);
py::object to_python(const c10::IValue& value);

// A reference to a Python object that C++ threads may copy and drop without
// holding the GIL (the last drop takes it).
class PyRef {
 public:
  PyRef() = default;
  explicit PyRef(py::object obj);
  py::object get() const;  // call with the GIL held
  explicit operator bool() const { return static_cast<bool>(obj_); }

 private:
  std::shared_ptr<py::object> obj_;
};

}  // namespace roundpipe::python

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
#include <stdexcept>

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

// A Python exception raised by code an engine thread ran (a layer, a loss,
// split, merge or step function), carried as a plain C++ exception: its
// message is formatted while the GIL is held, and the caller's thread raises
// the original exception object again (or sets it as a StageError's cause).
class PythonError : public std::runtime_error {
 public:
  explicit PythonError(const py::error_already_set& error);  // with the GIL held
  PyRef exception;
};

// A torch.OutOfMemoryError raised in Python code an engine thread ran (a
// layer of the caller's, a loss function): a c10::OutOfMemoryError to the
// engine, so that it recovers as from its own (Note [Out-of-memory redo]),
// carrying the Python exception for the caller. Its traceback's frames are
// cleared, or their locals (the tensors that filled the device) would stay
// alive through the retry.
class PythonOutOfMemoryError : public c10::OutOfMemoryError {
 public:
  explicit PythonOutOfMemoryError(const py::error_already_set& error);  // with the GIL held
  PyRef exception;
};

// True for a torch.OutOfMemoryError (with the GIL held).
bool is_torch_out_of_memory(const py::error_already_set& error);

// Gives the calling (engine) thread a Python thread state that lives as long
// as the thread, so that taking the GIL there does not create and delete one
// every time.
void keep_thread_state();

// Runs `f` with the GIL held; a Python exception leaves as PythonError (a
// torch.OutOfMemoryError as PythonOutOfMemoryError).
template <typename F>
decltype(auto) with_gil(F&& f) {
  keep_thread_state();
  py::gil_scoped_acquire gil;
  try {
    return f();
  } catch (py::error_already_set& e) {
    if (is_torch_out_of_memory(e)) throw PythonOutOfMemoryError(e);
    throw PythonError(e);
  }
}

}  // namespace roundpipe::python

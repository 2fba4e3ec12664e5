#include "pytree.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "runtime/values/ivalue_tree.h"

namespace roundpipe::python {
namespace {

int decref_pending(void* obj) {
  Py_DECREF(static_cast<PyObject*>(obj));
  return 0;
}

// Drops a Python reference from any thread. A thread without the GIL (an
// engine thread) hands the drop to the interpreter's main thread: the last
// reference to a RoundPipe dropped on one of its own threads would make it
// join itself. Once the interpreter is gone the object is leaked on purpose.
void drop(py::object& obj) {
  if (!obj) return;
  if (!Py_IsInitialized()) {
    obj.release();
    return;
  }
  if (PyGILState_Check()) {
    obj = py::object();
    return;
  }
  PyObject* raw = obj.release().ptr();
  if (Py_AddPendingCall(&decref_pending, raw) != 0) {  // queue full: drop it here
    keep_thread_state();
    py::gil_scoped_acquire gil;
    Py_DECREF(raw);
  }
}

bool python_equal(const py::object& a, const py::object& b) {
  keep_thread_state();
  py::gil_scoped_acquire gil;
  if (a.is(b)) return true;
  const int equal = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
  if (equal < 0) PyErr_Clear();  // not comparable: treat as different
  return equal == 1;
}

std::string python_repr(const py::object& obj) {
  keep_thread_state();
  py::gil_scoped_acquire gil;
  try {
    auto text = py::repr(obj).cast<std::string>();
    return text.size() > 200 ? text.substr(0, 200) + "..." : text;
  } catch (const py::error_already_set&) {
    return "<object>";
  }
}

// An object the engine carries without looking inside.
class PyLeaf final : public OpaqueValue {
 public:
  explicit PyLeaf(py::object obj) : obj_(std::move(obj)) {}
  ~PyLeaf() override { drop(obj_); }
  bool equals(const OpaqueValue& other) const override {
    auto* o = dynamic_cast<const PyLeaf*>(&other);
    return o && python_equal(obj_, o->obj_);
  }
  std::string describe() const override { return python_repr(obj_); }
  const py::object& object() const { return obj_; }

 private:
  py::object obj_;
};

// The kind of a pytree node (its unflatten function and context).
class PyNodeKind final : public OpaqueValue {
 public:
  PyNodeKind(py::object unflatten, py::object context, py::object type)
      : unflatten_(std::move(unflatten)), context_(std::move(context)), type_(std::move(type)) {}
  ~PyNodeKind() override {
    drop(unflatten_);
    drop(context_);
    drop(type_);
  }
  bool equals(const OpaqueValue& other) const override {
    auto* o = dynamic_cast<const PyNodeKind*>(&other);
    return o && python_equal(type_, o->type_) && python_equal(context_, o->context_);
  }
  std::string describe() const override { return "pytree node " + python_repr(type_); }
  py::object rebuild(py::list children) const { return unflatten_(std::move(children), context_); }

 private:
  py::object unflatten_, context_, type_;
};

c10::IValue capsule(c10::intrusive_ptr<OpaqueValue> value) {
  return c10::IValue::make_capsule(std::move(value));
}

const PyNodeKind* node_kind_of(const c10::IValue& value) {
  if (!value.isTuple()) return nullptr;
  const auto& e = value.toTupleRef().elements();
  if (e.empty()) return nullptr;
  return dynamic_cast<const PyNodeKind*>(as_opaque(e[0]));
}

struct PytreeModule {
  py::object get_node_type, supported_nodes;
};

const PytreeModule& pytree() {
  // Leaked on purpose: lives as long as the interpreter.
  static auto* m = [] {
    auto mod = py::module_::import("torch.utils._pytree");
    return new PytreeModule{mod.attr("_get_node_type"), mod.attr("SUPPORTED_NODES")};
  }();
  return *m;
}

}  // namespace

PyRef::PyRef(py::object obj)
    : obj_(new py::object(std::move(obj)), [](py::object* p) {
        drop(*p);
        delete p;
      }) {}

namespace {
// The Python traceback and "Type: message", formatted by Python's traceback
// module (so the caller sees where in the layer it was raised).
std::string describe_python_error(const py::error_already_set& error) {
  try {
    auto lines = py::module_::import("traceback")
                     .attr("format_exception")(error.type(), error.value(), error.trace());
    return py::str("").attr("join")(lines).cast<std::string>();
  } catch (const py::error_already_set&) {
    return py::str(error.type().attr("__name__")).cast<std::string>() + ": " +
           py::str(error.value()).cast<std::string>();
  }
}
}  // namespace

void keep_thread_state() {
  thread_local bool kept = false;
  if (kept || !Py_IsInitialized() || PyGILState_GetThisThreadState() != nullptr) return;
  kept = true;
  PyGILState_Ensure();  // never released: the state stays for the thread
  PyEval_SaveThread();  // but the GIL does not
}

PythonError::PythonError(const py::error_already_set& error)
    : std::runtime_error(describe_python_error(error)), exception(error.value()) {}

bool is_torch_out_of_memory(const py::error_already_set& error) {
  static const auto* type = new py::object(py::module_::import("torch").attr("OutOfMemoryError"));
  return error.matches(*type);
}

namespace {
std::string describe_and_clear_frames(const py::error_already_set& error) {
  std::string what = describe_python_error(error);
  if (error.trace()) py::module_::import("traceback").attr("clear_frames")(error.trace());
  error.value().attr("__traceback__") = py::none();
  return what;
}
}  // namespace

PythonOutOfMemoryError::PythonOutOfMemoryError(const py::error_already_set& error)
    : c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__},
                            describe_and_clear_frames(error)),
      exception(error.value()) {}

py::object PyRef::get() const {
  return obj_ ? *obj_ : py::none();
}

c10::IValue to_ivalue(py::handle obj) {
  if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
  if (obj.is_none()) return c10::IValue();
  if (PyBool_Check(obj.ptr())) return obj.cast<bool>();
  if (PyLong_CheckExact(obj.ptr())) {
    try {
      return obj.cast<int64_t>();
    } catch (const py::cast_error&) {  // too large for int64: keep the object
      return capsule(c10::make_intrusive<PyLeaf>(py::reinterpret_borrow<py::object>(obj)));
    }
  }
  if (PyFloat_CheckExact(obj.ptr())) return obj.cast<double>();
  if (PyUnicode_CheckExact(obj.ptr())) return obj.cast<std::string>();
  if (PyTuple_CheckExact(obj.ptr())) {
    std::vector<c10::IValue> elements;
    for (auto item : obj) elements.push_back(to_ivalue(item));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (PyList_CheckExact(obj.ptr())) {
    c10::impl::GenericList list(c10::AnyType::get());
    for (auto item : obj) list.push_back(to_ivalue(item));
    return list;
  }
  if (PyDict_CheckExact(obj.ptr())) {
    auto dict = py::reinterpret_borrow<py::dict>(obj);
    bool string_keys = true;
    for (auto item : dict) string_keys = string_keys && PyUnicode_CheckExact(item.first.ptr());
    if (string_keys) {
      c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
      for (auto item : dict) out.insert(item.first.cast<std::string>(), to_ivalue(item.second));
      return out;
    }
  }
  // Other pytree nodes: (kind, children...).
  const auto& tree = pytree();
  auto node_type = tree.get_node_type(obj);
  if (tree.supported_nodes.contains(node_type)) {
    auto def = tree.supported_nodes[node_type];
    auto flat = def.attr("flatten_fn")(obj).cast<py::tuple>();
    std::vector<c10::IValue> elements;
    elements.push_back(capsule(c10::make_intrusive<PyNodeKind>(
        def.attr("unflatten_fn"), flat[1], py::reinterpret_borrow<py::object>(node_type))));
    for (auto child : flat[0]) elements.push_back(to_ivalue(child));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return capsule(c10::make_intrusive<PyLeaf>(py::reinterpret_borrow<py::object>(obj)));
}

py::object to_python(const c10::IValue& value) {
  if (value.isTensor())
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(value.toTensor()));
  if (value.isNone()) return py::none();
  if (const auto* kind = node_kind_of(value)) {
    const auto& e = value.toTupleRef().elements();
    py::list children;
    for (size_t i = 1; i < e.size(); ++i) children.append(to_python(e[i]));
    return kind->rebuild(children);
  }
  if (value.isTuple()) {
    const auto& e = value.toTupleRef().elements();
    py::tuple out(e.size());
    for (size_t i = 0; i < e.size(); ++i) out[i] = to_python(e[i]);
    return out;
  }
  if (value.isList()) {
    py::list out;
    for (const auto& item : value.toListRef()) out.append(to_python(item));
    return out;
  }
  if (value.isGenericDict()) {
    py::dict out;
    for (const auto& entry : value.toGenericDict())
      out[to_python(entry.key())] = to_python(entry.value());
    return out;
  }
  if (const auto* opaque = as_opaque(value)) {
    if (auto* leaf = dynamic_cast<const PyLeaf*>(opaque)) return leaf->object();
  }
  return torch::jit::toPyObject(value);
}

}  // namespace roundpipe::python

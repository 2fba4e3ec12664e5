#include "py_layer.h"

#include <torch/csrc/autograd/python_variable.h>

namespace roundpipe::python {
namespace {

class PyModuleInstance final : public ModuleCopyInstance {
 public:
  PyModuleInstance(const Layer& layer, PyRef original, py::object copy,
                   std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                   bool takes_call_arguments)
      : ModuleCopyInstance(layer, std::move(params), std::move(buffers)),
        original_(std::move(original)),
        module_(std::move(copy)),
        takes_call_arguments_(takes_call_arguments) {}

  c10::IValue forward(const c10::IValue& input) override {
    return with_gil([&] {
      py::object module = module_.get();
      py::object out;
      if (takes_call_arguments_) {
        auto call = to_python(input);
        auto args = call[py::int_(0)];
        auto kwargs = call[py::int_(1)];
        out = module(*args, **kwargs);
      } else {
        out = module(to_python(input));
      }
      return to_ivalue(out);
    });
  }

 private:
  // The copy reads the original's current attributes (flags, train/eval
  // mode, hooks) as they are at this job, not as they were when it was made.
  void after_bind(bool training) override {
    with_gil([&] {
      py::module_::import("roundpipe._layer_copy").attr("refresh")(module_.get(), original_.get());
    });
  }

  PyRef original_;
  PyRef module_;
  bool takes_call_arguments_;
};

std::vector<std::pair<std::string, at::Tensor>> named_tensors(const py::object& items) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto item : items) {
    auto pair = item.cast<py::tuple>();
    out.emplace_back(pair[0].cast<std::string>(), THPVariable_Unpack(pair[1].ptr()));
  }
  return out;
}

}  // namespace

PyModuleLayer::PyModuleLayer(py::object module, bool takes_call_arguments)
    : takes_call_arguments_(takes_call_arguments) {
  py::object type = py::type::of(module);
  type_name_ = type.attr("__module__").cast<std::string>() + "." +
               type.attr("__qualname__").cast<std::string>();
  for (auto& [name, t] : named_tensors(module.attr("named_parameters")())) {
    param_names_.push_back(name);
    params_.push_back(t);
  }
  for (auto& [name, t] : named_tensors(module.attr("named_buffers")())) {
    TORCH_CHECK(!t.requires_grad(), "layer ", type_name_, ": buffer '", name,
                "' requires grad; buffers must not (make it an nn.Parameter if it is trained)");
    buffer_names_.push_back(name);
    buffers_.push_back(t);
  }
  module_ = PyRef(std::move(module));
}

void PyModuleLayer::set_parameter_data(size_t i, const at::Tensor& data) {
  TORCH_CHECK(i < params_.size(), "parameter index ", i, " out of range");
  params_[i].set_data(data);  // the Python nn.Parameter is this tensor: it sees the change
}

bool PyModuleLayer::is_training() const {
  return with_gil([&] { return module_.get().attr("training").cast<bool>(); });
}

std::unique_ptr<LayerInstance> PyModuleLayer::make_instance() {
  return with_gil([&] { return make_instance_with_gil(); });
}

std::unique_ptr<LayerInstance> PyModuleLayer::make_instance_with_gil() {
  // A copy of the module whose parameters and buffers are empty placeholders
  // (roundpipe/_layer_copy.py): binding fills them with device tensors.
  auto copy = py::module_::import("roundpipe._layer_copy").attr("structural_copy")(module_.get());
  std::vector<at::Tensor> params, buffers;
  for (auto& [name, t] : named_tensors(copy.attr("named_parameters")())) params.push_back(t);
  for (auto& [name, t] : named_tensors(copy.attr("named_buffers")())) buffers.push_back(t);
  return std::make_unique<PyModuleInstance>(*this, module_, std::move(copy), std::move(params),
                                            std::move(buffers), takes_call_arguments_);
}

}  // namespace roundpipe::python

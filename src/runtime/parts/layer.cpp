#include "roundpipe/layer.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>

#include <set>

namespace roundpipe {
namespace {

c10::IValue to_ivalue(torch::nn::AnyValue&& value, const std::string& type_name) {
  if (auto* t = value.try_get<at::Tensor>()) return *t;
  if (auto* v = value.try_get<c10::IValue>()) return *v;
  TORCH_CHECK(false, "layer ", type_name, " returned a value of type ",
              c10::demangle(value.type_info().name()),
              "; RoundPipe layers return at::Tensor or c10::IValue (tuples/lists/dicts of "
              "tensors and scalars)");
}

bool is_argument_type_error(const c10::Error& e) {
  return e.msg().find("Expected argument #0 to be of type") != std::string::npos;
}

class TorchModuleInstance final : public ModuleCopyInstance {
 public:
  TorchModuleInstance(TorchModuleLayer* layer, torch::nn::AnyModule module)
      : ModuleCopyInstance(*layer, module.ptr()->parameters(/*recurse=*/true),
                           module.ptr()->buffers(/*recurse=*/true)),
        layer_(layer),
        module_(std::move(module)) {}

  c10::IValue forward(const c10::IValue& input) override {
    using Kind = TorchModuleLayer::ArgKind;
    const int kind = layer_->arg_kind.load();
    if (kind != static_cast<int>(Kind::kIValue) && input.isTensor()) {
      try {
        auto out = module_.any_forward(input.toTensor());
        layer_->arg_kind.store(static_cast<int>(Kind::kTensor));
        return to_ivalue(std::move(out), layer_->type_name());
      } catch (const c10::Error& e) {
        if (kind == static_cast<int>(Kind::kTensor) || !is_argument_type_error(e)) throw;
      }
    }
    try {
      auto out = module_.any_forward(input);
      layer_->arg_kind.store(static_cast<int>(Kind::kIValue));
      return to_ivalue(std::move(out), layer_->type_name());
    } catch (const c10::Error& e) {
      if (!is_argument_type_error(e)) throw;
      TORCH_CHECK(false, "layer ", layer_->type_name(), " takes an at::Tensor but got a ",
                  input.tagKind(),
                  " (the previous layer's whole output). Make its forward take c10::IValue.");
    }
  }

 private:
  TorchModuleLayer* layer_;
  void after_bind(bool training) override { module_.ptr()->train(training); }

  torch::nn::AnyModule module_;
};

}  // namespace

ModuleCopyInstance::ModuleCopyInstance(const Layer& layer, std::vector<at::Tensor> params,
                                       std::vector<at::Tensor> buffers)
    : type_name_(layer.type_name()), params_(std::move(params)), buffers_(std::move(buffers)) {
  TORCH_CHECK(
      params_.size() == layer.parameters().size() && buffers_.size() == layer.buffers().size(),
      "layer ", type_name_, ": its copy has ", params_.size(), " parameters and ", buffers_.size(),
      " buffers, the layer ", layer.parameters().size(), " and ", layer.buffers().size());
  // Binding rebinds the copy's tensors in place, so they must be the copy's
  // own: a reset() that registers a tensor it was given (a tied weight)
  // hands the copy the original's tensor.
  std::set<const c10::TensorImpl*> home;
  for (const auto& t : layer.parameters()) home.insert(t.unsafeGetTensorImpl());
  for (const auto& t : layer.buffers()) home.insert(t.unsafeGetTensorImpl());
  for (const auto& t : params_) {
    TORCH_CHECK(!home.count(t.unsafeGetTensorImpl()), "layer ", type_name_,
                ": its copy shares a parameter tensor with the original (e.g. a clone() whose "
                "reset() registers a tensor it was given, such as a tied weight). RoundPipe "
                "runs copies of each layer on the devices; make the copy get its own tensors "
                "(the tie itself stays: RoundPipe ties parameters by the identity of the "
                "original modules' tensors).");
  }
  for (const auto& t : buffers_) {
    TORCH_CHECK(!home.count(t.unsafeGetTensorImpl()), "layer ", type_name_,
                ": its copy shares a buffer tensor with the original; make the copy get its "
                "own tensors.");
  }
  unbind();  // the copy's own weights are not needed
}

void ModuleCopyInstance::bind(const std::vector<at::Tensor>& params,
                              const std::vector<bool>& requires_grad,
                              const std::vector<at::Tensor>& buffers, bool training) {
  TORCH_CHECK(params.size() == params_.size() && buffers.size() == buffers_.size(), "layer ",
              type_name_, " changed its parameters or buffers after wrapping");
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].set_data(params[i]);
    params_[i].mutable_grad() = at::Tensor();
    params_[i].requires_grad_(requires_grad[i]);
  }
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].set_data(buffers[i]);
  after_bind(training);
}

void ModuleCopyInstance::unbind() {
  for (auto& p : params_) {
    p.set_data(at::empty({0}, p.options()));
    p.mutable_grad() = at::Tensor();
  }
  for (auto& b : buffers_) b.set_data(at::empty({0}, b.options()));
}

std::vector<at::Tensor> ModuleCopyInstance::buffer_values() {
  // Fresh handles: unbind() rebinds buffers_ in place while a download of
  // these values may still be in flight.
  std::vector<at::Tensor> values;
  for (const auto& b : buffers_) values.push_back(b.detach());
  return values;
}

TorchModuleLayer::TorchModuleLayer(torch::nn::AnyModule module) : module_(std::move(module)) {}

std::string TorchModuleLayer::type_name() const {
  return c10::demangle(module_.type_info().name());
}
std::vector<at::Tensor> TorchModuleLayer::parameters() const {
  return module_.ptr()->parameters(/*recurse=*/true);
}
std::vector<at::Tensor> TorchModuleLayer::buffers() const {
  return module_.ptr()->buffers(/*recurse=*/true);
}
std::vector<std::string> TorchModuleLayer::parameter_names() const {
  return module_.ptr()->named_parameters(/*recurse=*/true).keys();
}
std::vector<std::string> TorchModuleLayer::buffer_names() const {
  return module_.ptr()->named_buffers(/*recurse=*/true).keys();
}
void TorchModuleLayer::set_parameter_data(size_t i, const at::Tensor& data) {
  auto params = parameters();
  TORCH_CHECK(i < params.size(), "parameter index ", i, " out of range");
  params[i].set_data(data);
}
bool TorchModuleLayer::is_training() const {
  return module_.ptr()->is_training();
}

const SplitsInputRows* TorchModuleLayer::row_splitter() const {
  const auto* splitter = dynamic_cast<const SplitsInputRows*>(module_.ptr().get());
  return splitter != nullptr && splitter->splits_rows() ? splitter : nullptr;
}

namespace {
thread_local bool instance_in_making = false;
}

bool making_layer_instance() {
  return instance_in_making;
}

std::unique_ptr<LayerInstance> TorchModuleLayer::make_instance() {
  struct Flag {
    Flag() { instance_in_making = true; }
    ~Flag() { instance_in_making = false; }
  } flag;
  return std::make_unique<TorchModuleInstance>(this, module_.clone());
}

namespace {

class HomeParametersLayer final : public Layer {
 public:
  HomeParametersLayer(LayerPtr inner, std::vector<at::Tensor> homes)
      : inner_(std::move(inner)), homes_(std::move(homes)) {
    auto own = inner_->parameters();
    const auto names = inner_->parameter_names();
    TORCH_CHECK(own.size() == homes_.size(), "layer ", inner_->type_name(), " has ", own.size(),
                " parameters but ", homes_.size(), " home tensors were given");
    for (size_t i = 0; i < own.size(); ++i) {
      TORCH_CHECK(homes_[i].defined() && homes_[i].sizes() == own[i].sizes() &&
                      homes_[i].scalar_type() == own[i].scalar_type(),
                  "layer ", inner_->type_name(), ": the home tensor for parameter '", names[i],
                  "' is ", homes_[i].defined() ? homes_[i].toString() : std::string("undefined"),
                  " of shape ", homes_[i].defined() ? homes_[i].sizes() : c10::IntArrayRef{},
                  " but the layer needs ", own[i].toString(), " of shape ", own[i].sizes());
    }
  }
  std::string type_name() const override { return inner_->type_name(); }
  std::vector<at::Tensor> parameters() const override { return homes_; }
  std::vector<at::Tensor> buffers() const override { return inner_->buffers(); }
  std::vector<std::string> parameter_names() const override { return inner_->parameter_names(); }
  std::vector<std::string> buffer_names() const override { return inner_->buffer_names(); }
  void set_parameter_data(size_t i, const at::Tensor& data) override {
    TORCH_CHECK(i < homes_.size(), "parameter index ", i, " out of range");
    homes_[i].set_data(data);
  }
  bool is_training() const override { return inner_->is_training(); }
  std::unique_ptr<LayerInstance> make_instance() override { return inner_->make_instance(); }
  bool meterable() const override { return inner_->meterable(); }
  const SplitsInputRows* row_splitter() const override { return inner_->row_splitter(); }

 private:
  LayerPtr inner_;
  std::vector<at::Tensor> homes_;
};

}  // namespace

LayerPtr with_home_parameters(LayerPtr inner, std::vector<at::Tensor> homes) {
  return std::make_shared<HomeParametersLayer>(std::move(inner), std::move(homes));
}

std::vector<LayerPtr> layers_of(const torch::nn::Sequential& sequential) {
  std::vector<LayerPtr> layers;
  for (const auto& module : *sequential)
    layers.push_back(std::make_shared<TorchModuleLayer>(module));
  return layers;
}

}  // namespace roundpipe

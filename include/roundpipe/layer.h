// The unit the engine schedules: something with parameters and buffers that
// can run `IValue forward(IValue)` on device copies of them.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/nn/modules/container/sequential.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

namespace roundpipe {

// A layer bound to one job's device copies of its parameters and buffers. A
// layer may run on two devices at once (the next iteration's forward beside
// this one's backward), so each job takes its own instance.
class LayerInstance {
 public:
  virtual ~LayerInstance() = default;
  // Binds the device tensors, in the order of Layer::parameters()/buffers().
  // Parameter leaves get requires_grad as `requires_grad[i]` and no grad.
  virtual void bind(const std::vector<at::Tensor>& params, const std::vector<bool>& requires_grad,
                    const std::vector<at::Tensor>& buffers, bool training) = 0;
  // Drops the device tensors (and their grads).
  virtual void unbind() = 0;
  // The autograd leaves standing for the parameters, whose .grad accumulates.
  virtual std::vector<at::Tensor> parameter_leaves() = 0;
  // The buffers as the layer left them (it may write its own buffers).
  virtual std::vector<at::Tensor> buffer_values() = 0;
  virtual c10::IValue forward(const c10::IValue& input) = 0;
};

class Layer;

// Note [Tail row chunks]
// A module may say how to split its input into chunks of rows (dim 0 of
// its batch tensors). It then promises that it and every layer after it
// treat rows independently: running them on the chunks one after another
// and concatenating their outputs (tensors of one or more dimensions on
// dim 0; 0-dim tensors, such as a loss that is a sum over tokens divided by
// a fixed count, added) gives the whole input's result; and that they draw
// no random numbers and save nothing for recompute. Where the loss adds up
// over rows as well (RunConfig::loss_sums_over_rows) and memory is short,
// the fused tail then runs each microbatch chunk by chunk, keeping one
// chunk's activations at a time instead of recomputing layers
// (planner.cpp, runtime/stage/row_chunks.cpp). The presets' decoder layers and output
// adapter do.
class SplitsInputRows {
 public:
  virtual ~SplitsInputRows() = default;
  // `input` as handed between stages (host tensors) split into chunks of
  // rows[0], rows[1], ... rows, in order (the rows add up to the input's);
  // empty where this input cannot be split so.
  virtual std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                                    const std::vector<int64_t>& rows) const = 0;
  // Whether this module may be run in row chunks now (false, e.g., while
  // it draws random numbers).
  virtual bool splits_rows() const { return true; }
};

// An instance that is a copy of the layer's module(s): binding replaces the
// data of the copy's own parameter and buffer tensors. Frontends (C++
// modules, Python modules) derive from it and add forward().
class ModuleCopyInstance : public LayerInstance {
 public:
  // `params` and `buffers`: the copy's tensors, in the order of the layer's;
  // they must not be the layer's home tensors.
  ModuleCopyInstance(const Layer& layer, std::vector<at::Tensor> params,
                     std::vector<at::Tensor> buffers);
  void bind(const std::vector<at::Tensor>& params, const std::vector<bool>& requires_grad,
            const std::vector<at::Tensor>& buffers, bool training) override;
  void unbind() override;
  std::vector<at::Tensor> parameter_leaves() override { return params_; }
  std::vector<at::Tensor> buffer_values() override;

 protected:
  // Called after binding: bring the copy's state (at least train/eval mode)
  // up to date with the layer's.
  virtual void after_bind(bool training) = 0;
  std::string type_name_;

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> buffers_;
};

class Layer {
 public:
  virtual ~Layer() = default;
  // A short description for error messages, e.g. "torch::nn::LinearImpl".
  virtual std::string type_name() const = 0;
  // Home (CPU) tensors. The same tensor may appear in several layers (tied
  // weights); the engine uploads and accumulates it once per stage.
  virtual std::vector<at::Tensor> parameters() const = 0;
  virtual std::vector<at::Tensor> buffers() const = 0;
  // Names of the parameters, in the order of parameters() ("inner.weight").
  virtual std::vector<std::string> parameter_names() const = 0;
  virtual std::vector<std::string> buffer_names() const = 0;
  // Replaces the home tensor of parameter/buffer i (e.g. with a pinned copy).
  virtual void set_parameter_data(size_t i, const at::Tensor& data) = 0;
  virtual bool is_training() const = 0;
  virtual std::unique_ptr<LayerInstance> make_instance() = 0;
  // Whether the engine may meter this layer's forward (what it keeps for
  // its backward) through the thread's memory reporter, a slot the
  // profiler shares: not for a forward that may itself query or start the
  // profiler (Python code).
  virtual bool meterable() const { return true; }
  // How to split this layer's input by rows, if it can (Note [Tail row
  // chunks]); nullptr: it cannot.
  virtual const SplitsInputRows* row_splitter() const { return nullptr; }
};
using LayerPtr = std::shared_ptr<Layer>;

// A torch::nn module (a child of a torch::nn::Sequential). Its forward may
// take and return at::Tensor (standard modules) or c10::IValue (custom
// modules passing tuples/lists/dicts of tensors and scalars). Instances are
// made with clone(), so custom modules derive from torch::nn::Cloneable.
class TorchModuleLayer final : public Layer {
 public:
  explicit TorchModuleLayer(torch::nn::AnyModule module);
  std::string type_name() const override;
  std::vector<at::Tensor> parameters() const override;
  std::vector<at::Tensor> buffers() const override;
  std::vector<std::string> parameter_names() const override;
  std::vector<std::string> buffer_names() const override;
  void set_parameter_data(size_t i, const at::Tensor& data) override;
  bool is_training() const override;
  std::unique_ptr<LayerInstance> make_instance() override;
  // The module's, where it derives from SplitsInputRows.
  const SplitsInputRows* row_splitter() const override;

  // How forward takes its argument, learned at the first call.
  enum class ArgKind : int { kUnknown = 0, kTensor = 1, kIValue = 2 };
  std::atomic<int> arg_kind{0};

 private:
  torch::nn::AnyModule module_;
};

// True on a thread while RoundPipe makes a layer's device instance with the
// module's clone(): the instance's tensors are replaced by device copies at
// once, so a module's reset()/clone() may allocate without initialising or
// copying (the presets do; for large layers this saves seconds and memory).
bool making_layer_instance();

// `inner` with its parameters' home tensors replaced by `homes` (same
// order, shapes and dtypes): the weights live in tensors another framework
// owns (the Python presets run native layers on HuggingFace's parameters).
// `inner`'s own parameter tensors are never read: allocate them untouched
// (e.g. CausalLMOptions::init_weights = false). Instances are inner's.
LayerPtr with_home_parameters(LayerPtr inner, std::vector<at::Tensor> homes);

// One layer per child of `sequential`.
std::vector<LayerPtr> layers_of(const torch::nn::Sequential& sequential);

}  // namespace roundpipe

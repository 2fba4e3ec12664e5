#include "roundpipe/wrap.h"

#include <c10/util/Exception.h>

namespace roundpipe {
namespace {

void check_preset_choice(const WrapOptions& options) {
  TORCH_CHECK(options.use_sequential_preset.value_or(true),
              "wrap_model_to_roundpipe: use_sequential_preset=false asks for automatic splitting, "
              "which the C++ API does not offer; build a torch::nn::Sequential (input adapter, "
              "blocks, output adapter) and pass it to RoundPipe, or use a preset (qwen3, llama)");
}

}  // namespace

WrappedCausalLM::WrappedCausalLM(models::CausalLM model, RoundPipeOptions options)
    : model_(std::move(model)) {
  if (options.name.empty()) options.name = model_.config().model_type;
  pipe_ = std::make_unique<RoundPipe>(model_.sequential(), std::move(options));
}

at::Tensor WrappedCausalLM::forward_backward(models::CausalLMInput input, const RunConfig& config) {
  TORCH_CHECK(input.labels.defined(), pipe_->name(),
              ": forward_backward needs labels (input_ids shifted inside the model, -100 "
              "ignored); for logits call the RoundPipe's forward()");
  if (!input.num_items_in_batch) {
    const int64_t items = models::count_loss_tokens(input.labels);
    if (items > 0) input.num_items_in_batch = static_cast<double>(items);
  }
  // The output adapter returns each microbatch's share of the loss.
  return pipe_
      ->forward_backward(
          input.to_ivalue(), c10::IValue(),
          [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); }, false, config)
      .loss;
}

void WrappedCausalLM::save_pretrained(const std::string& dir) {
  pipe_->synchronize();
  model_.save_pretrained(dir);
}

std::unique_ptr<WrappedCausalLM> wrap_model_to_roundpipe(const std::string& checkpoint_dir,
                                                         const WrapOptions& options) {
  check_preset_choice(options);
  // With pinned copies wanted and GPUs to feed, load the checkpoint straight
  // into pinned memory instead of pinning a second copy afterwards.
  auto model_options = options.model;
  const std::string spec =
      options.roundpipe.devices.empty() ? default_device_spec() : options.roundpipe.devices;
  if (options.roundpipe.pin_model == PinMode::kAlloc && options.roundpipe.device_list.empty() &&
      spec.rfind("sim", 0) != 0 && cuda_device_count() > 0) {
    model_options.pin_memory = true;
  }
  // With pin_model=off the weights stay pageable: the checkpoint's own
  // mapped pages serve (page cache, which the kernel may drop and read
  // again), so a model larger than host memory trains. register pins what
  // was loaded in place: it loads a copy.
  if (options.roundpipe.pin_model == PinMode::kOff) model_options.map_weights = true;
  return std::make_unique<WrappedCausalLM>(
      models::CausalLM::from_pretrained(checkpoint_dir, model_options), options.roundpipe);
}

std::unique_ptr<WrappedCausalLM> wrap_model_to_roundpipe(models::CausalLM model,
                                                         const WrapOptions& options) {
  check_preset_choice(options);
  return std::make_unique<WrappedCausalLM>(std::move(model), options.roundpipe);
}

}  // namespace roundpipe

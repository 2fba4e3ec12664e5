// wrap_model_to_roundpipe: one call from a HuggingFace checkpoint (or a
// loaded preset model) to a RoundPipe, as in the seed document.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "roundpipe/models/causal_lm.h"
#include "roundpipe/roundpipe.h"

namespace roundpipe {

struct WrapOptions {
  // true: a preset is required; unset: use a preset when one exists;
  // false: automatic splitting (not available in C++: build a Sequential).
  std::optional<bool> use_sequential_preset;
  models::CausalLMOptions model;  // dtype, return_logits, loss chunking
  RoundPipeOptions roundpipe;

  WrapOptions& set_use_sequential_preset(bool v) {
    use_sequential_preset = v;
    return *this;
  }
  WrapOptions& set_model(models::CausalLMOptions v) {
    model = v;
    return *this;
  }
  WrapOptions& set_roundpipe(RoundPipeOptions v) {
    roundpipe = std::move(v);
    return *this;
  }
};

// A preset model wrapped in a RoundPipe; the original model's config,
// vocab_size and save_pretrained stay reachable.
class WrappedCausalLM {
 public:
  WrappedCausalLM(models::CausalLM model, RoundPipeOptions options);
  RoundPipe& pipe() { return *pipe_; }
  RoundPipe* operator->() { return pipe_.get(); }
  models::CausalLM& model() { return model_; }
  const models::CausalLMConfig& config() const { return model_.config(); }
  int64_t vocab_size() const { return model_.vocab_size(); }
  // One training call on `input` (labels required): the loss and its
  // gradients are the whole batch's token-weighted mean for any
  // num_microbatch, as transformers' num_items_in_batch makes them
  // (num_items_in_batch = count_loss_tokens(labels) unless given). Returns
  // that loss.
  at::Tensor forward_backward(models::CausalLMInput input, const RunConfig& config = {});
  // Synchronizes (publishing the latest weights), then writes the
  // HuggingFace checkpoint.
  void save_pretrained(const std::string& dir);

 private:
  models::CausalLM model_;
  std::unique_ptr<RoundPipe> pipe_;
};

// The model type comes from the checkpoint's config.json; an unknown type
// gives an error listing the supported presets (qwen3, llama).
std::unique_ptr<WrappedCausalLM> wrap_model_to_roundpipe(const std::string& checkpoint_dir,
                                                         const WrapOptions& options = {});
std::unique_ptr<WrappedCausalLM> wrap_model_to_roundpipe(models::CausalLM model,
                                                         const WrapOptions& options = {});

}  // namespace roundpipe

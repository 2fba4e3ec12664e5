// CausalLM: a preset's Sequential composed of its building blocks (the
// input adapter, the decoder layers, the output adapter: model_ends.h,
// decoder_layer.h), initialised as transformers initialises new weights.
// Which blocks a family's layers use, its config.json says
// (models/families/); HuggingFace IO is hf_io.cpp, LoRA lora.cpp.
#include "roundpipe/models/causal_lm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <set>

#include "models/decoder_layer.h"
#include "models/model_ends.h"
#include "models/modules.h"
#include "models/rope.h"

namespace roundpipe::models {
using namespace detail;  // the building blocks

CausalLM::CausalLM(CausalLMConfig config, CausalLMOptions options)
    : config_(std::move(config)), options_(options) {
  InputAdapter input(config_);
  sequential_->push_back(input);
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i)
    sequential_->push_back(
        DecoderLayer(config_, options_.mlp_chunk_tokens, options_.expert_chunk_tokens, i,
                     options_.grouped_experts, options_.lora, options_.base_quantization(),
                     options_.quantize_experts ? options_.base_quantization() : std::nullopt));
  sequential_->push_back(OutputAdapter(
      config_, options_, config_.tie_word_embeddings ? input->embed_tokens->weight : at::Tensor()));
  c10::NoGradGuard no_grad;
  check_lora(config_, options_.lora);
  const auto quantized = quantized_weights();
  std::set<const c10::TensorImpl*> kept;  // quantized: their tensors keep their own dtypes
  for (const auto& [name, q] : quantized)
    for (const auto& t : q->tensors()) kept.insert(t.unsafeGetTensorImpl());
  auto pin_if_asked = [&] {
    if (!options_.pin_memory) return;
    // Tied weights are one tensor: pin each once.
    std::set<const c10::TensorImpl*> done;
    for (auto& p : sequential_->parameters()) {
      if (done.insert(p.unsafeGetTensorImpl()).second) p.set_data(p.pin_memory());
    }
  };
  if (!options_.init_weights) {
    // Uninitialised, in the model dtype, memory untouched (rotary tables stay fp32).
    for (auto& p : sequential_->parameters())
      if (!kept.count(p.unsafeGetTensorImpl()))
        p.set_data(at::empty(p.sizes(), p.options().dtype(options_.dtype)));
    init_lora();
    pin_if_asked();
    return;
  }
  // transformers' initialisation for new weights: normal(0, 0.02), norms 1.
  for (auto& item : sequential_->named_parameters()) {
    const auto& name = item.key();
    if (kept.count(item.value().unsafeGetTensorImpl())) continue;  // below
    if (name.size() >= 5 && name.substr(name.size() - 5) == ".bias") {
      item.value().zero_();
    } else if (name.find("norm") == std::string::npos) {
      item.value().normal_(0, 0.02);
    }
  }
  sequential_->to(options_.dtype);
  // A new quantized weight: transformers' normal(0, 0.02) in dtype, quantized.
  for (auto& [name, q] : quantized) q->set(at::empty(q->shape).normal_(0, 0.02).to(options_.dtype));
  input->inv_freq.set_data(inverse_frequencies(config_));  // rotary tables stay fp32
  init_lora();
  pin_if_asked();
}

}  // namespace roundpipe::models

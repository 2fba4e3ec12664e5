// CausalLM: a preset's Sequential composed of its building blocks (the
// input adapter, the decoder layers, the output adapter: model_ends.h,
// decoder_layer.h), initialised as transformers initialises new weights.
// Which blocks a family's layers use, its config.json says
// (models/families/); HuggingFace IO is hf_io.cpp, LoRA lora.cpp.
#include "roundpipe/models/causal_lm.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <limits>
#include <set>

#include "models/decoder_layer.h"
#include "models/model_ends.h"
#include "models/modules.h"
#include "models/rope.h"
#include "support/parallel.h"

namespace roundpipe::models {
using namespace detail;  // the building blocks
namespace {

// normal(0, std) values in `dtype`, drawn in parallel: chunks of 2^20 values
// each from its own generator, seeded from the default one (so
// torch::manual_seed decides them, whatever the thread count). One generator
// draws ~0.1 G values a second: a 32B model's weights would take minutes.
// (On the process's CPU pool: at::parallel_for runs on one thread here.)
at::Tensor random_normal(at::IntArrayRef sizes, double std, c10::ScalarType dtype) {
  auto out = at::empty(sizes, at::TensorOptions().dtype(dtype));
  auto flat = out.view({-1});
  const int64_t seed =
      at::randint(std::numeric_limits<int64_t>::max(), {1}, at::kLong).item<int64_t>();
  constexpr int64_t kChunk = int64_t{1} << 20;
  const int64_t chunks = (flat.numel() + kChunk - 1) / kChunk;
  parallel_for_each(chunks, [&](int64_t c) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed + c));
    const int64_t len = std::min(kChunk, flat.numel() - c * kChunk);
    const auto draws = at::empty({len}).normal_(0, std, gen);  // (a one-thread kernel)
    const float* from = draws.const_data_ptr<float>();
    // Converted by hand: ATen's copy_ would start an OpenMP team in each pool thread.
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "random_normal", [&] {
      scalar_t* to = flat.mutable_data_ptr<scalar_t>() + c * kChunk;
      for (int64_t i = 0; i < len; ++i) to[i] = static_cast<scalar_t>(from[i]);
    });
  });
  return out;
}

}  // namespace

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
  // transformers' initialisation for new weights: normal(0, 0.02), norms 1;
  // each weight made in the model dtype at once (never the model in fp32).
  for (auto& item : sequential_->named_parameters()) {
    const auto& name = item.key();
    auto& p = item.value();
    if (kept.count(p.unsafeGetTensorImpl())) continue;  // below
    if (name.size() >= 5 && name.substr(name.size() - 5) == ".bias") {
      p.set_data(at::zeros(p.sizes(), p.options().dtype(options_.dtype)));
    } else if (name.find("norm") == std::string::npos) {
      p.set_data(random_normal(p.sizes(), 0.02, options_.dtype));
    } else {
      p.set_data(p.to(options_.dtype));
    }
  }
  sequential_->to(options_.dtype);  // the buffers
  // A new quantized weight: transformers' normal(0, 0.02) in dtype, quantized.
  for (auto& [name, q] : quantized) q->set(random_normal(q->shape, 0.02, options_.dtype));
  input->inv_freq.set_data(inverse_frequencies(config_));  // rotary tables stay fp32
  init_lora();
  pin_if_asked();
}

}  // namespace roundpipe::models

// The two ends of a preset's Sequential: the input adapter (embedding,
// rotary tables, the attention layout, once per microbatch) and the output
// adapter (final norm, lm_head, the loss). Internal header (its one user:
// causal_lm.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>

#include <optional>
#include <vector>

#include "models/attention.h"
#include "models/experts.h"
#include "models/model_input.h"
#include "models/modules.h"
#include "models/rope.h"
#include "roundpipe/layer.h"
#include "roundpipe/models/causal_lm.h"

namespace roundpipe::models::detail {

// Embedding, rotary tables and the attention layout, computed once per
// microbatch and handed to every decoder layer in the tuple (hidden, cos,
// sin, layout or None, labels or None, return_logits or None,
// num_items_in_batch or None[, router statistics]).
struct InputAdapterImpl : torch::nn::Cloneable<InputAdapterImpl> {
  CausalLMConfig config;
  Embedding embed_tokens{nullptr};
  at::Tensor inv_freq;
  explicit InputAdapterImpl(CausalLMConfig c) : config(std::move(c)) { reset(); }
  void reset() override {
    embed_tokens =
        register_module("embed_tokens", Embedding(config.vocab_size, config.hidden_size));
    inv_freq = register_buffer("inv_freq", inverse_frequencies(config));
  }
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    return copy_module(*this, [&] { return std::make_shared<InputAdapterImpl>(config); });
  }
  c10::IValue forward(c10::IValue input) {
    const auto in = parse_input(input);
    at::Tensor hidden;
    if (in.inputs_embeds.defined()) {
      hidden = in.inputs_embeds;
      TORCH_CHECK(hidden.dim() == 3 && hidden.size(2) == config.hidden_size,
                  "inputs_embeds must be [batch, sequence, hidden_size = ", config.hidden_size,
                  "], got ", hidden.sizes());
      hidden = hidden.to(embed_tokens->weight.scalar_type());
    } else {
      TORCH_CHECK(in.input_ids.dim() == 2, "input_ids must be [batch, sequence], got ",
                  in.input_ids.sizes());
      hidden = embed_tokens(in.input_ids);
    }
    const int64_t B = hidden.size(0), T = hidden.size(1);
    const auto positions = token_positions(in, B, T, inv_freq.options());
    const auto [cos, sin] =
        rotary_tables(positions, inv_freq, config.rope_scaling, hidden.scalar_type());
    // Padding and packing become variable-length sequences (no [T, T]
    // mask); read on the host, then the offsets travel with the activations.
    c10::IValue layout;
    if (auto l = sequence_layout(in.attention_mask, in.position_ids, B, T)) {
      l->token_index = l->token_index.to(hidden.device());
      l->cu_seqlens = l->cu_seqlens.to(hidden.device());
      layout = l->to_ivalue();
    }
    auto optional = [](const auto& v) { return v ? c10::IValue(*v) : c10::IValue(); };
    std::vector<c10::IValue> out{hidden,
                                 cos,
                                 sin,
                                 layout,
                                 in.labels.defined() ? c10::IValue(in.labels) : c10::IValue(),
                                 optional(in.return_logits),
                                 optional(in.num_items_in_batch)};
    // (Note [Router load-balancing loss]: the loss's router statistics.)
    if (config.router_loss() && in.labels.defined())
      out.emplace_back(at::zeros({2 * config.num_experts + 1}, inv_freq.options()));
    return c10::ivalue::Tuple::create(std::move(out));
  }
};
TORCH_MODULE(InputAdapter);

// Final norm, lm_head and the loss. With tied embeddings the lm_head weight
// is the input adapter's embedding tensor (registered here as "tied_weight",
// so RoundPipe sees one parameter used by two layers).
struct OutputAdapterImpl : torch::nn::Cloneable<OutputAdapterImpl>, SplitsInputRows {
  CausalLMConfig config;
  CausalLMOptions options;
  at::Tensor tied;  // the embedding weight when tied, else undefined
  RMSNorm norm{nullptr};
  Linear lm_head{nullptr};  // untied
  at::Tensor weight;        // lm_head's weight, or the tied embedding
  OutputAdapterImpl(CausalLMConfig c, CausalLMOptions o, at::Tensor tied_weight)
      : config(std::move(c)), options(o), tied(std::move(tied_weight)) {
    reset();
  }
  void reset() override {
    norm = register_module("norm", RMSNorm(config.hidden_size, config.rms_norm_eps));
    if (tied.defined()) {
      weight = register_parameter("tied_weight", tied);
    } else {
      lm_head =
          register_module("lm_head", make_linear(config.hidden_size, config.vocab_size, false));
      weight = lm_head->weight;
    }
  }
  // The copy gets tensors of its own (RoundPipe binds device copies into it).
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    return copy_module(*this, [&] {
      return std::make_shared<OutputAdapterImpl>(
          config, options,
          tied.defined() ? at::empty(tied.sizes(), tied.options()).requires_grad_() : at::Tensor());
    });
  }
  c10::IValue forward(c10::IValue input) {
    const auto& e = input.toTupleRef().elements();
    auto h = norm(e[0].toTensor());
    if (!e[4].isTensor()) return at::linear(h, weight);
    // HuggingFace's loss: labels shifted left, -100 ignored, summed and
    // divided by num_items_in_batch when given (the whole batch's count, so
    // that microbatch losses add up to the batch's mean), else by this
    // microbatch's own count.
    auto labels = e[4].toTensor();
    auto shifted = at::constant_pad_nd(labels, {0, 1}, -100).narrow(1, 1, labels.size(1));
    const int64_t D = h.size(-1);
    const bool return_logits =
        e.size() > 5 && e[5].isBool() ? e[5].toBool() : options.return_logits;
    const std::optional<double> divisor =
        e.size() > 6 && e[6].isDouble() ? std::optional<double>(e[6].toDouble()) : std::nullopt;
    // Note [Router load-balancing loss]: weighted like the cross-entropy.
    at::Tensor router_loss;
    if (e.size() > 7 && e[7].isTensor()) {
      router_loss = router_aux_loss(e[7].toTensor()) * config.router_aux_loss_coef;
      if (divisor)  // (the labelled tokens counted on the device: no host round trip)
        router_loss = router_loss * shifted.ne(-100).sum().to(router_loss.scalar_type()) / *divisor;
    }
    auto plus_router_loss = [&](const at::Tensor& loss) {
      return router_loss.defined() ? loss + router_loss.to(loss.scalar_type()) : loss;
    };
    if (!return_logits) {
      return plus_router_loss(chunked_linear_cross_entropy(
          h.reshape({-1, D}), weight, shifted.reshape({-1}), options.loss_chunk_tokens, divisor));
    }
    auto logits = at::linear(h, weight);
    const auto flat = logits.to(at::kFloat).reshape({-1, logits.size(-1)});
    auto loss =
        divisor
            ? at::cross_entropy_loss(flat, shifted.reshape({-1}), {}, at::Reduction::Sum, -100)
                  .div(*divisor)
            : at::cross_entropy_loss(flat, shifted.reshape({-1}), {}, at::Reduction::Mean, -100);
    return c10::ivalue::Tuple::create({plus_router_loss(loss), logits});
  }
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    return split_decoder_input_rows(input, rows);
  }
  bool splits_rows() const override { return !config.router_loss(); }
};
TORCH_MODULE(OutputAdapter);

}  // namespace roundpipe::models::detail

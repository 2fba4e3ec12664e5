// The presets' decoder layer: pre-norm self-attention and a dense MLP or a
// mixture of experts, each added to the residual stream. Which blocks a
// layer has is the config's (CausalLMConfig: q/k norms, windows, sinks,
// sparse layers), as each family's file (models/families/) reads it.
// Internal header (its one user: causal_lm.cpp).
#pragma once

#include <torch/nn/cloneable.h>

#include <optional>
#include <vector>

#include "models/experts.h"
#include "models/mlp.h"
#include "models/model_input.h"
#include "models/modules.h"
#include "models/self_attention.h"
#include "roundpipe/layer.h"

namespace roundpipe::models::detail {

struct DecoderLayerImpl : torch::nn::Cloneable<DecoderLayerImpl>, SplitsInputRows {
  CausalLMConfig config;
  int64_t mlp_chunk_tokens, expert_chunk_tokens;
  int64_t index;  // which layer: its attention window
  bool grouped_experts;
  Attention self_attn{nullptr};
  MLP mlp{nullptr};        // a dense layer's
  SparseMoe moe{nullptr};  // a sparse one's (registered as "mlp", as transformers names it)
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LoraOptions lora;
  std::optional<BaseQuantization> quant;         // the dense projections' base weights quantized
  std::optional<BaseQuantization> expert_quant;  // the experts' (Note [Quantized experts])
  DecoderLayerImpl(CausalLMConfig c, int64_t mlp_chunk, int64_t expert_chunk, int64_t layer,
                   bool grouped, LoraOptions l, std::optional<BaseQuantization> q = std::nullopt,
                   std::optional<BaseQuantization> eq = std::nullopt)
      : config(std::move(c)),
        mlp_chunk_tokens(mlp_chunk),
        expert_chunk_tokens(expert_chunk),
        index(layer),
        grouped_experts(grouped),
        lora(std::move(l)),
        quant(q),
        expert_quant(eq) {
    reset();
  }
  void reset() override {
    self_attn = register_module("self_attn",
                                Attention(config, config.attention_window(index), lora, quant));
    if (config.sparse_layer(index)) {
      moe = register_module(
          "mlp", SparseMoe(config, grouped_experts, expert_chunk_tokens, lora, expert_quant));
    } else {
      mlp = register_module("mlp", MLP(config, lora, quant));
      // (The token-chunked MLP takes the base weights only.)
      const bool mlp_lora = lora.rank > 0 && (lora.targets_projection("gate_proj") ||
                                              lora.targets_projection("up_proj") ||
                                              lora.targets_projection("down_proj"));
      mlp->chunk_tokens = mlp_lora ? 0 : mlp_chunk_tokens;
    }
    input_layernorm =
        register_module("input_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps));
    post_attention_layernorm = register_module("post_attention_layernorm",
                                               RMSNorm(config.hidden_size, config.rms_norm_eps));
  }
  c10::IValue forward(c10::IValue input) {
    const auto& e = input.toTupleRef().elements();
    auto h = e[0].toTensor();
    const auto layout = SequenceLayout::from_ivalue(e[3]);
    h = h + self_attn(input_layernorm(h), e[1].toTensor(), e[2].toTensor(), layout);
    const auto normed = post_attention_layernorm(h);
    at::Tensor stats = e.size() > 7 && e[7].isTensor() ? e[7].toTensor() : at::Tensor();
    h = h + (moe ? moe(normed, layout, stats.defined() ? &stats : nullptr) : mlp(normed));
    // Everything but the hidden state and the router statistics passes on.
    std::vector<c10::IValue> out(e.begin(), e.end());
    out[0] = h;
    if (stats.defined()) out[7] = stats;
    return c10::ivalue::Tuple::create(std::move(out));
  }
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    return copy_module(*this, [&] {
      return std::make_shared<DecoderLayerImpl>(config, mlp_chunk_tokens, expert_chunk_tokens,
                                                index, grouped_experts, lora, quant, expert_quant);
    });
  }
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    return split_decoder_input_rows(input, rows);
  }
  // LoRA dropout draws random numbers: a row chunk would draw others; the
  // router statistics are the whole microbatch's.
  bool splits_rows() const override {
    return (lora.rank == 0 || lora.dropout == 0) && !config.router_loss();
  }
};
TORCH_MODULE(DecoderLayer);

}  // namespace roundpipe::models::detail

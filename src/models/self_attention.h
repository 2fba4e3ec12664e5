// The presets' self-attention module: q/k/v/o projections (with LoRA where
// asked), Qwen3's q/k norms, rotary embeddings, grouped-query causal
// attention over padded or packed sequences (attention.h), sliding windows
// and GPT-OSS's sinks. Internal header (its one user: decoder_layer.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>

#include <cmath>
#include <optional>

#include "models/attention.h"
#include "models/modules.h"
#include "roundpipe/models/config.h"
#include "roundpipe/models/fused_ops.h"

namespace roundpipe::models::detail {

// Submodule and parameter names follow transformers', so that the state dict
// maps one to one ("self_attn.q_proj.weight", "mlp.gate_proj.weight", ...).
struct AttentionImpl : torch::nn::Cloneable<AttentionImpl> {
  CausalLMConfig config;
  int64_t window;  // sliding window; 0: full causal attention
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  at::Tensor sinks;  // GPT-OSS: Note [Attention sinks]
  LoraOptions lora;
  std::optional<BaseQuantization> quant;  // the projections' base weights quantized
  AttentionImpl(CausalLMConfig c, int64_t w, LoraOptions l,
                std::optional<BaseQuantization> q = std::nullopt)
      : config(std::move(c)), window(w), lora(std::move(l)), quant(q) {
    reset();
  }
  void reset() override {
    const auto& c = config;
    q_proj =
        register_module("q_proj", make_linear(c.hidden_size, c.num_attention_heads * c.head_dim,
                                              c.attention_bias, lora, "q_proj", quant));
    k_proj =
        register_module("k_proj", make_linear(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                              c.attention_bias, lora, "k_proj", quant));
    v_proj =
        register_module("v_proj", make_linear(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                              c.attention_bias, lora, "v_proj", quant));
    o_proj =
        register_module("o_proj", make_linear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                              c.attention_bias, lora, "o_proj", quant));
    if (c.qk_norm) {
      q_norm = register_module("q_norm", RMSNorm(c.head_dim, c.rms_norm_eps));
      k_norm = register_module("k_norm", RMSNorm(c.head_dim, c.rms_norm_eps));
    }
    if (c.attention_sinks) sinks = register_parameter("sinks", at::empty({c.num_attention_heads}));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::optional<SequenceLayout>& layout) {
    const int64_t B = x.size(0), T = x.size(1), hd = config.head_dim;
    auto q = q_proj(x).view({B, T, -1, hd});
    auto k = k_proj(x).view({B, T, -1, hd});
    auto v = v_proj(x).view({B, T, -1, hd});
    if (config.qk_norm) {
      q = q_norm(q);
      k = k_norm(k);
    }
    // Rotary in the projections' [B, T, heads, hd] layout (no copy);
    // attention takes that layout too.
    q = ops::rotary(q, cos, sin);
    k = ops::rotary(k, cos, sin);
    auto attn =
        causal_attention(q, k, v, layout, 1.0 / std::sqrt(static_cast<double>(hd)), window, sinks);
    return o_proj(attn.reshape({B, T, -1}));
  }
};
TORCH_MODULE(Attention);

}  // namespace roundpipe::models::detail

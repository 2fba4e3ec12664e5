// HuggingFace config.json for decoder-only causal LMs (Qwen3, Qwen3-MoE,
// Llama 3.x).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace roundpipe::models {

struct RopeScaling {
  std::string type = "default";  // "default", "llama3" or "yarn"
  double factor = 1.0;
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  int64_t original_max_position_embeddings = 8192;
  // yarn (transformers' _compute_yarn_parameters): the frequency ramp's
  // bounds in rotations, whether they round to whole dimensions, and the
  // factor cos and sin are multiplied by.
  double beta_fast = 32, beta_slow = 1;
  bool truncate = true;
  double attention_factor = 1.0;
};

struct CausalLMConfig {
  std::string model_type;  // "qwen3", "qwen3_moe", "llama" or "gpt_oss"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  bool qk_norm = false;  // Qwen3: RMSNorm on each head's queries and keys
  // Sliding-window attention (Qwen3's use_sliding_window, sliding_window,
  // max_window_layers, or config.json's layer_types): per layer, 0 for full
  // causal attention, else how many keys a query sees, itself included (as
  // transformers: key j is seen from query i when i - window < j <= i).
  // Empty: every layer full.
  std::vector<int64_t> attention_windows;
  // Mixture of experts (Qwen3-MoE; num_experts 0: every layer dense). A
  // layer is sparse unless mlp_only_layers names it, and where
  // (layer + 1) % decoder_sparse_step == 0: a router of num_experts picks
  // num_experts_per_tok experts of moe_intermediate_size per token (their
  // probabilities renormalised to sum to 1 with norm_topk_prob).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // The router's load-balancing loss (Note [Router load-balancing loss]):
  // with output_router_logits the loss gains router_aux_loss_coef times it.
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;
  // GPT-OSS (Note [GPT-OSS]): a bias on the router and on every expert's
  // projections, the experts' weights stored [E, in, out] with gate and up
  // columns interleaved, the clamped gated activation (swiglu_limit > 0),
  // and a learned attention sink per head.
  bool router_bias = false;
  bool gpt_oss_experts = false;
  double swiglu_limit = 0;
  bool attention_sinks = false;
  std::string torch_dtype;  // as written, e.g. "bfloat16"
  std::string json;         // the whole file, kept for save_pretrained

  // Parses and checks a config.json; errors name the file and the field.
  static CausalLMConfig from_json_file(const std::string& path);
  static CausalLMConfig from_json_string(const std::string& text, const std::string& what);
  std::string to_json_string() const;
  // Layer `layer`'s attention window (0: full causal attention).
  int64_t attention_window(int64_t layer) const {
    return attention_windows.empty() ? 0 : attention_windows.at(layer);
  }
  // Whether the loss includes the router's load-balancing loss.
  bool router_loss() const { return output_router_logits && num_experts > 0; }
  // Whether layer `layer`'s MLP is a mixture of experts.
  bool sparse_layer(int64_t layer) const {
    for (int64_t l : mlp_only_layers)
      if (l == layer) return false;
    return num_experts > 0 && (layer + 1) % decoder_sparse_step == 0;
  }
};

}  // namespace roundpipe::models

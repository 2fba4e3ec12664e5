// GPT-OSS (model_type "gpt_oss", Note [GPT-OSS]): every layer a mixture of
// experts with a biased router and biased, interleaved, clamped experts
// (MXFP4 on disk: hf_io.cpp), attention with biases and a learned sink per
// head (Note [Attention sinks]), sliding windows on alternate layers.
#include <cmath>

#include "models/config_json.h"
#include "models/families/family.h"

namespace roundpipe::models::detail {
namespace {

// GPT-OSS (Note [GPT-OSS]): every layer sparse, experts of
// intermediate_size, the router's top-k logits softmaxed (the full
// softmax's top-k renormalised), sliding_window (128) on the layers
// layer_types names sliding_attention (by default every even layer).
void read_gpt_oss_layers(const nlohmann::json& j, CausalLMConfig& c, const std::string& what) {
  c.num_experts = optional<int64_t>(j, "num_local_experts", 128, what);
  c.num_experts_per_tok = optional<int64_t>(j, "num_experts_per_tok", 4, what);
  c.moe_intermediate_size = c.intermediate_size;
  c.norm_topk_prob = true;
  c.router_bias = true;
  c.gpt_oss_experts = true;
  c.swiglu_limit = 7.0;  // transformers' GptOssExperts.limit
  c.attention_sinks = true;
  TORCH_CHECK(
      c.num_experts >= 1 && c.num_experts_per_tok >= 1 && c.num_experts_per_tok <= c.num_experts,
      what, ": num_experts_per_tok must be in [1, num_local_experts]");
  const auto window = optional<int64_t>(j, "sliding_window", 128, what);
  std::vector<std::string> types;
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    types = required<std::vector<std::string>>(j, "layer_types", what);
  } else {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
  }
  TORCH_CHECK(static_cast<int64_t>(types.size()) == c.num_hidden_layers, what, ": layer_types has ",
              types.size(), " entries for ", c.num_hidden_layers, " layers");
  for (const auto& t : types) {
    TORCH_CHECK(t == "full_attention" || t == "sliding_attention", what, ": layer type '", t,
                "' is not implemented by the presets (full_attention, sliding_attention)");
    TORCH_CHECK(t == "full_attention" || window > 0, what,
                ": sliding_attention layers need a positive sliding_window");
    c.attention_windows.push_back(t == "sliding_attention" ? window : 0);
  }
}

void read_gpt_oss(const nlohmann::json& j, CausalLMConfig& c, const std::string& what) {
  read_gpt_oss_layers(j, c, what);
  c.output_router_logits = optional<bool>(j, "output_router_logits", false, what);
  c.router_aux_loss_coef = optional<double>(j, "router_aux_loss_coef", 0.001, what);
  TORCH_CHECK(std::isfinite(c.router_aux_loss_coef) && c.router_aux_loss_coef >= 0, what,
              ": router_aux_loss_coef must be a finite number >= 0");
}

}  // namespace

const ModelFamily& gpt_oss_family() {
  // (GPT-OSS's rms_norm_eps is 1e-5, and its attention has biases.)
  static const ModelFamily family{"gpt_oss", 1e-5, true, read_gpt_oss};
  return family;
}

}  // namespace roundpipe::models::detail

// Qwen3-MoE (model_type "qwen3_moe"): Qwen3's attention, and a mixture of
// experts in place of the MLP on its sparse layers (experts.h), with the
// router's optional load-balancing loss (Note [Router load-balancing loss]).
#include <cmath>

#include "models/config_json.h"
#include "models/families/family.h"

namespace roundpipe::models::detail {
namespace {

// Qwen3-MoE's experts (transformers 5 writes num_experts as
// num_local_experts).
void read_qwen3_moe_experts(const nlohmann::json& j, CausalLMConfig& c, const std::string& what) {
  c.num_experts = j.contains("num_experts") ? required<int64_t>(j, "num_experts", what)
                                            : optional<int64_t>(j, "num_local_experts", 0, what);
  c.num_experts_per_tok = optional<int64_t>(j, "num_experts_per_tok", 8, what);
  c.moe_intermediate_size = optional<int64_t>(j, "moe_intermediate_size", 768, what);
  c.norm_topk_prob = optional<bool>(j, "norm_topk_prob", false, what);
  c.decoder_sparse_step = optional<int64_t>(j, "decoder_sparse_step", 1, what);
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null())
    c.mlp_only_layers = required<std::vector<int64_t>>(j, "mlp_only_layers", what);
  TORCH_CHECK(c.num_experts >= 0 && c.decoder_sparse_step >= 1, what,
              ": num_experts must be >= 0 and decoder_sparse_step >= 1");
  TORCH_CHECK(
      c.num_experts == 0 || (c.num_experts_per_tok >= 1 && c.num_experts_per_tok <= c.num_experts &&
                             c.moe_intermediate_size >= 1),
      what,
      ": num_experts_per_tok must be in [1, num_experts] and "
      "moe_intermediate_size positive");
  c.output_router_logits = optional<bool>(j, "output_router_logits", false, what);
  c.router_aux_loss_coef = optional<double>(j, "router_aux_loss_coef", 0.001, what);
  TORCH_CHECK(std::isfinite(c.router_aux_loss_coef) && c.router_aux_loss_coef >= 0, what,
              ": router_aux_loss_coef must be a finite number >= 0, got ", c.router_aux_loss_coef);
}

void read_qwen3_moe(const nlohmann::json& j, CausalLMConfig& c, const std::string& what) {
  c.qk_norm = true;
  read_qwen3_moe_experts(j, c, what);
  read_qwen3_attention_windows(j, c, what);
}

}  // namespace

const ModelFamily& qwen3_moe_family() {
  static const ModelFamily family{"qwen3_moe", 1e-6, false, read_qwen3_moe};
  return family;
}

}  // namespace roundpipe::models::detail

// LoRA on the presets: the options (targets, scaling, the experts'
// factors), their checks, peft's initialisation and the merge into the
// base weights. The adapters themselves are in modules.h (LinearImpl) and
// experts.h (Note [Expert LoRA]).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "models/experts.h"
#include "models/modules.h"
#include "roundpipe/models/causal_lm.h"

namespace roundpipe::models {
using namespace detail;  // the building blocks (modules.h, experts.h)

double LoraOptions::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / rank;
}

bool LoraOptions::targets_projection(const std::string& projection) const {
  if (rank <= 0 || projection.empty()) return false;
  if (targets.empty()) return target_parameters.empty();
  return std::find(targets.begin(), targets.end(), projection) != targets.end() ||
         std::find(targets.begin(), targets.end(), "all-linear") != targets.end();
}

namespace {
// Whether `target` names the stacked expert weight `weight` as peft
// matches target_parameters: the whole "mlp.experts.<weight>" or an
// ending of it at a dot.
bool names_expert_weight(const std::string& target, const std::string& weight) {
  const std::string full = "mlp.experts." + weight;
  if (target.empty() || target.size() > full.size()) return false;
  const size_t at = full.size() - target.size();
  return full.compare(at, target.size(), target) == 0 && (at == 0 || full[at - 1] == '.');
}
}  // namespace

LoraOptions LoraOptions::for_experts(const std::string& weight) const {
  LoraOptions o = *this;
  if (auto it = expert_rank.find(weight); it != expert_rank.end()) o.rank = it->second;
  if (auto it = expert_alpha.find(weight); it != expert_alpha.end()) o.alpha = it->second;
  return o;
}

bool LoraOptions::targets_experts(const std::string& weight) const {
  if (rank <= 0) return false;
  return std::any_of(target_parameters.begin(), target_parameters.end(),
                     [&](const std::string& t) { return names_expert_weight(t, weight); });
}

bool CausalLM::is_lora_name(const std::string& hf_name) {
  return hf_name.find(".lora_A.") != std::string::npos ||
         hf_name.find(".lora_B.") != std::string::npos;
}

namespace detail {

void check_lora(const CausalLMConfig& config, const LoraOptions& lora) {
  if (lora.rank > 0) {
    static const std::set<std::string> known = {"q_proj",    "k_proj",  "v_proj",    "o_proj",
                                                "gate_proj", "up_proj", "down_proj", "all-linear"};
    for (const auto& t : lora.targets)
      TORCH_CHECK(known.count(t), "LoRA target '", t, "' is not a projection of the ",
                  config.model_type,
                  " preset: name q_proj, k_proj, v_proj, o_proj, gate_proj, "
                  "up_proj, down_proj, or all-linear");
    TORCH_CHECK(lora.dropout >= 0 && lora.dropout < 1, "LoRA dropout must be in [0, 1), got ",
                lora.dropout);
    for (const auto& t : lora.target_parameters)
      TORCH_CHECK(names_expert_weight(t, "gate_up_proj") || names_expert_weight(t, "down_proj"),
                  "LoRA target parameter '", t,
                  "' is not an expert weight of the presets: name mlp.experts.gate_up_proj or "
                  "mlp.experts.down_proj");
    TORCH_CHECK(lora.target_parameters.empty() || config.num_experts > 0,
                "LoRA targets the "
                "experts' weights, but this ",
                config.model_type,
                " model has no experts: leave "
                "target_parameters empty");
    TORCH_CHECK(lora.target_parameters.empty() || lora.dropout == 0,
                "LoRA on the experts' weights (target_parameters) takes no dropout, as in peft: "
                "set the dropout to 0");
  }
}

}  // namespace detail

// LoRA adapters start as peft's: A as nn.Linear's weight (kaiming-uniform,
// a = sqrt(5): uniform(+-1/sqrt(in))), B zero, so the model starts as the
// base; every other parameter is frozen.
void CausalLM::init_lora() {
  if (options_.lora.rank <= 0) return;
  c10::NoGradGuard no_grad;
  for (auto& item : sequential_->named_parameters()) {
    auto& p = item.value();
    const auto& name = item.key();
    const auto dtype = options_.lora.dtype.value_or(options_.dtype);
    if (name.find("lora_A.") != std::string::npos) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(p.size(1)));
      p.set_data(at::empty(p.sizes(), p.options().dtype(dtype)).uniform_(-bound, bound));
    } else if (name.find("lora_B.") != std::string::npos) {
      p.set_data(at::zeros(p.sizes(), p.options().dtype(dtype)));
    } else {
      p.requires_grad_(false);
    }
  }
}

void CausalLM::merge_lora() {
  const auto& lora = options_.lora;
  if (lora.rank <= 0) return;
  TORCH_CHECK(!options_.quantize_base,
              "merge_lora: the base weights are quantized (quantize_base); adding the adapters "
              "would quantize the sum again and lose them. Save the adapter (save_adapter: peft "
              "loads it onto the quantized base), or load the base without quantize_base to "
              "merge.");
  c10::NoGradGuard no_grad;
  for (const auto& module : sequential_->modules(/*include_self=*/false)) {
    if (auto* experts = dynamic_cast<MoeExpertsImpl*>(module.get())) {  // Note [Expert LoRA]
      auto merge = [&](const at::Tensor& stacked, const LoraFactors& adapter) {
        if (!adapter) return;
        const auto delta =
            at::bmm(adapter->b(at::kFloat), adapter->a(at::kFloat)) * adapter->scaling;
        auto weight = experts->out_in(stacked);  // (a view: the copy writes the weights)
        weight.copy_(weight.to(at::kFloat) + delta);
        adapter->lora_B->weight.zero_();
      };
      merge(experts->gate_up_proj, experts->gate_up_lora);
      merge(experts->down_proj, experts->down_lora);
      continue;
    }
    auto* linear = dynamic_cast<LinearImpl*>(module.get());
    if (linear == nullptr || linear->lora.rank == 0) continue;
    const auto& A = linear->lora_A->weight;
    const auto& B = linear->lora_B->weight;
    const auto delta = at::matmul(B.to(at::kFloat), A.to(at::kFloat)) * lora.scaling();
    linear->weight.copy_(linear->weight.to(at::kFloat) + delta);
    B.zero_();
  }
}

}  // namespace roundpipe::models

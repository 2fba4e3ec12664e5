// Qwen3 (model_type "qwen3"): Llama's decoder with an RMSNorm on each
// head's queries and keys (q_norm, k_norm), and optional sliding-window
// attention on some layers.
#include "models/config_json.h"
#include "models/families/family.h"

namespace roundpipe::models::detail {

// Qwen3's sliding window, as transformers reads it: only with
// use_sliding_window is there a window (sliding_window is None otherwise);
// then the layers layer_types names "sliding_attention", or without
// layer_types those from max_window_layers on.
void read_qwen3_attention_windows(const nlohmann::json& j, CausalLMConfig& c,
                                  const std::string& what) {
  const bool use = optional<bool>(j, "use_sliding_window", false, what);
  // (An absent sliding_window is transformers' default, 4096; null is none.)
  int64_t window = 0;
  if (use)
    window = j.contains("sliding_window") ? optional<int64_t>(j, "sliding_window", 0, what) : 4096;
  if (window == 0) return;
  TORCH_CHECK(window > 0, what, ": sliding_window must be positive, got ", window);
  std::vector<std::string> types;
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    types = required<std::vector<std::string>>(j, "layer_types", what);
    TORCH_CHECK(static_cast<int64_t>(types.size()) == c.num_hidden_layers, what,
                ": layer_types has ", types.size(), " entries for ", c.num_hidden_layers,
                " layers");
  } else {
    const auto first = optional<int64_t>(j, "max_window_layers", 28, what);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      types.push_back(l >= first ? "sliding_attention" : "full_attention");
  }
  for (const auto& t : types) {
    TORCH_CHECK(t == "full_attention" || t == "sliding_attention", what, ": layer type '", t,
                "' is not implemented by the presets (full_attention, sliding_attention)");
    c.attention_windows.push_back(t == "sliding_attention" ? window : 0);
  }
}

namespace {

void read_qwen3(const nlohmann::json& j, CausalLMConfig& c, const std::string& what) {
  c.qk_norm = true;
  read_qwen3_attention_windows(j, c, what);
}

}  // namespace

const ModelFamily& qwen3_family() {
  static const ModelFamily family{"qwen3", 1e-6, false, read_qwen3};
  return family;
}

}  // namespace roundpipe::models::detail

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>
#include <vector>

#include "roundpipe/models/config.h"

namespace roundpipe::models {
namespace {

// nlohmann converts between JSON number kinds silently (2.5 would read as
// the integer 2): each field is checked for its exact kind first.
template <typename T>
bool has_kind(const nlohmann::json& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    return v.is_number_integer();
  } else if constexpr (std::is_floating_point_v<T>) {
    return v.is_number();
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return v.is_array() &&
           std::all_of(v.begin(), v.end(), [](const nlohmann::json& e) { return e.is_string(); });
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return v.is_array() && std::all_of(v.begin(), v.end(), [](const nlohmann::json& e) {
             return e.is_number_integer();
           });
  } else {
    return v.is_string();
  }
}

template <typename T>
const char* kind_name() {
  if constexpr (std::is_same_v<T, bool>) {
    return "true or false";
  } else if constexpr (std::is_integral_v<T>) {
    return "a whole number";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "a number";
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return "a list of strings";
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return "a list of whole numbers";
  } else {
    return "a string";
  }
}

template <typename T>
T required(const nlohmann::json& j, const char* key, const std::string& what) {
  TORCH_CHECK(j.contains(key) && !j[key].is_null(), what, ": missing required field '", key, "'");
  TORCH_CHECK(has_kind<T>(j[key]), what, ": field '", key, "' has the wrong type: it must be ",
              kind_name<T>(), ", got ", j[key].dump());
  return j[key].get<T>();
}

template <typename T>
T optional(const nlohmann::json& j, const char* key, T fallback, const std::string& what) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return required<T>(j, key, what);
}

// Qwen3's sliding window, as transformers reads it: only with
// use_sliding_window is there a window (sliding_window is None otherwise);
// then the layers layer_types names "sliding_attention", or without
// layer_types those from max_window_layers on. Llama has none.
void parse_attention_windows(const nlohmann::json& j, CausalLMConfig& c, const std::string& what) {
  if (c.model_type != "qwen3" && c.model_type != "qwen3_moe") return;
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

// GPT-OSS (Note [GPT-OSS]): every layer sparse, experts of
// intermediate_size, the router's top-k logits softmaxed (the full
// softmax's top-k renormalised), sliding_window (128) on the layers
// layer_types names sliding_attention (by default every even layer).
void parse_gpt_oss(const nlohmann::json& j, CausalLMConfig& c, const std::string& what) {
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

// Qwen3-MoE's experts (transformers 5 writes num_experts as
// num_local_experts).
void parse_experts(const nlohmann::json& j, CausalLMConfig& c, const std::string& what) {
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

}  // namespace

CausalLMConfig CausalLMConfig::from_json_file(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "cannot open model config ", path);
  std::stringstream text;
  text << in.rdbuf();
  return from_json_string(text.str(), path);
}

CausalLMConfig CausalLMConfig::from_json_string(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, what, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), what, ": a config must be a JSON object");
  CausalLMConfig c;
  c.json = text;
  c.model_type = required<std::string>(j, "model_type", what);
  const bool gpt_oss = c.model_type == "gpt_oss";
  TORCH_CHECK(
      c.model_type == "qwen3" || c.model_type == "qwen3_moe" || c.model_type == "llama" || gpt_oss,
      what, ": model_type '", c.model_type,
      "' has no preset; supported presets: qwen3, qwen3_moe, llama, gpt_oss");
  c.vocab_size = required<int64_t>(j, "vocab_size", what);
  c.hidden_size = required<int64_t>(j, "hidden_size", what);
  c.intermediate_size = required<int64_t>(j, "intermediate_size", what);
  c.num_hidden_layers = required<int64_t>(j, "num_hidden_layers", what);
  c.num_attention_heads = required<int64_t>(j, "num_attention_heads", what);
  c.num_key_value_heads = optional<int64_t>(j, "num_key_value_heads", c.num_attention_heads, what);
  c.head_dim = optional<int64_t>(j, "head_dim", c.hidden_size / c.num_attention_heads, what);
  c.max_position_embeddings = optional<int64_t>(j, "max_position_embeddings", 4096, what);
  c.rms_norm_eps = optional<double>(j, "rms_norm_eps", gpt_oss ? 1e-5 : 1e-6, what);
  c.tie_word_embeddings = optional<bool>(j, "tie_word_embeddings", false, what);
  c.attention_bias = optional<bool>(j, "attention_bias", gpt_oss, what);
  c.mlp_bias = optional<bool>(j, "mlp_bias", false, what);
  c.qk_norm = c.model_type == "qwen3" || c.model_type == "qwen3_moe";
  if (c.model_type == "qwen3_moe") parse_experts(j, c, what);
  if (gpt_oss) {
    parse_gpt_oss(j, c, what);
    c.output_router_logits = optional<bool>(j, "output_router_logits", false, what);
    c.router_aux_loss_coef = optional<double>(j, "router_aux_loss_coef", 0.001, what);
    TORCH_CHECK(std::isfinite(c.router_aux_loss_coef) && c.router_aux_loss_coef >= 0, what,
                ": router_aux_loss_coef must be a finite number >= 0");
  }
  // What else changes the computation: a setting the presets do not
  // implement is an error here, never a silent approximation.
  const auto act = optional<std::string>(j, "hidden_act", "silu", what);
  TORCH_CHECK(act == "silu", what, ": hidden_act '", act,
              "' is not implemented by the presets (they compute SiLU MLPs)");
  const auto dropout = optional<double>(j, "attention_dropout", 0.0, what);
  TORCH_CHECK(dropout == 0.0, what, ": attention_dropout ", dropout,
              " is not implemented by the presets; set it to 0.0 in config.json (most "
              "checkpoints have 0.0), or train the model as Python layers");
  const auto tp = optional<int64_t>(j, "pretraining_tp", 1, what);
  TORCH_CHECK(tp == 1, what, ": pretraining_tp ", tp,
              " is not implemented by the presets; set it to 1 in config.json");
  parse_attention_windows(j, c, what);
  c.torch_dtype = optional<std::string>(j, "torch_dtype",
                                        optional<std::string>(j, "dtype", "float32", what), what);
  // Rotary parameters: transformers 5 writes "rope_parameters"; older files
  // "rope_theta" and "rope_scaling".
  nlohmann::json rope = nlohmann::json::object();
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object())
    rope = j["rope_parameters"];
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) rope.update(j["rope_scaling"]);
  c.rope_theta =
      optional<double>(rope, "rope_theta", optional<double>(j, "rope_theta", 10000.0, what), what);
  const std::string type = optional<std::string>(
      rope, "rope_type", optional<std::string>(rope, "type", "default", what), what);
  TORCH_CHECK(type == "default" || type == "llama3" || type == "yarn", what, ": rope type '", type,
              "' is not supported (supported: default, llama3, yarn)");
  c.rope_scaling.type = type;
  if (type == "llama3") {
    c.rope_scaling.factor = required<double>(rope, "factor", what + " rope_scaling");
    c.rope_scaling.low_freq_factor =
        required<double>(rope, "low_freq_factor", what + " rope_scaling");
    c.rope_scaling.high_freq_factor =
        required<double>(rope, "high_freq_factor", what + " rope_scaling");
    c.rope_scaling.original_max_position_embeddings =
        required<int64_t>(rope, "original_max_position_embeddings", what + " rope_scaling");
  }
  if (type == "yarn") {  // transformers' _compute_yarn_parameters
    auto& r = c.rope_scaling;
    const std::string w = what + " rope_parameters";
    r.original_max_position_embeddings =
        required<int64_t>(rope, "original_max_position_embeddings", w);
    r.factor = optional<double>(rope, "factor",
                                static_cast<double>(c.max_position_embeddings) /
                                    static_cast<double>(r.original_max_position_embeddings),
                                w);
    r.beta_fast = optional<double>(rope, "beta_fast", 32, w);
    r.beta_slow = optional<double>(rope, "beta_slow", 1, w);
    r.truncate = optional<bool>(rope, "truncate", true, w);
    TORCH_CHECK(r.factor > 0 && r.original_max_position_embeddings > 0 && r.beta_fast > 0 &&
                    r.beta_slow > 0,
                w,
                ": yarn needs factor, beta_fast, beta_slow and "
                "original_max_position_embeddings > 0");
    auto mscale = [](double scale, double m) {
      return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
    };
    const double m = optional<double>(rope, "mscale", 0, w);
    const double m_all = optional<double>(rope, "mscale_all_dim", 0, w);
    r.attention_factor = optional<double>(
        rope, "attention_factor",
        m != 0 && m_all != 0 ? mscale(r.factor, m) / mscale(r.factor, m_all) : mscale(r.factor, 1),
        w);
  }
  TORCH_CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 &&
                  c.num_hidden_layers > 0 && c.num_attention_heads > 0 &&
                  c.num_key_value_heads > 0 && c.head_dim > 0,
              what, ": sizes must be positive");
  TORCH_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, what, ": num_attention_heads (",
              c.num_attention_heads, ") must be a multiple of num_key_value_heads (",
              c.num_key_value_heads, ")");
  TORCH_CHECK(c.head_dim % 2 == 0, what, ": head_dim must be even for rotary embeddings");
  TORCH_CHECK(c.max_position_embeddings > 0, what, ": max_position_embeddings must be positive");
  TORCH_CHECK(c.rms_norm_eps > 0 && std::isfinite(c.rms_norm_eps), what,
              ": rms_norm_eps must be a positive number, got ", c.rms_norm_eps);
  TORCH_CHECK(c.rope_theta > 0 && std::isfinite(c.rope_theta), what,
              ": rope_theta must be a positive number, got ", c.rope_theta);
  if (type == "llama3") {
    const auto& r = c.rope_scaling;
    TORCH_CHECK(r.factor > 0 && r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor &&
                    r.original_max_position_embeddings > 0,
                what,
                ": llama3 rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
                "and original_max_position_embeddings > 0");
  }
  return c;
}

std::string CausalLMConfig::to_json_string() const {
  // The weights are saved dequantised (Note [MXFP4 experts]): a
  // quantization_config would tell transformers otherwise.
  if (json.find("quantization_config") == std::string::npos) return json;
  auto j = nlohmann::ordered_json::parse(json);
  j.erase("quantization_config");
  return j.dump(2);
}

}  // namespace roundpipe::models

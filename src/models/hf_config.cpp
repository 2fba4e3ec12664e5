// config.json: the fields every preset reads, then its family's own
// (models/families/), with their exact JSON kinds; errors name the file
// and the field.
#include <c10/util/Exception.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "models/config_json.h"
#include "models/families/family.h"
#include "roundpipe/models/config.h"

namespace roundpipe::models {

namespace detail {

const std::vector<const ModelFamily*>& model_families() {
  // One line per family, in the order errors list them.
  static const std::vector<const ModelFamily*> families = {&qwen3_family(), &qwen3_moe_family(),
                                                           &llama_family(), &gpt_oss_family()};
  return families;
}

const ModelFamily* find_model_family(const std::string& model_type) {
  for (const auto* family : model_families())
    if (family->model_type == model_type) return family;
  return nullptr;
}

}  // namespace detail

using namespace detail;

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
  const ModelFamily* family = find_model_family(c.model_type);
  if (family == nullptr) {
    std::string names;
    for (const auto* f : model_families()) names += (names.empty() ? "" : ", ") + f->model_type;
    TORCH_CHECK(false, what, ": model_type '", c.model_type,
                "' has no preset; supported presets: ", names);
  }
  c.vocab_size = required<int64_t>(j, "vocab_size", what);
  c.hidden_size = required<int64_t>(j, "hidden_size", what);
  c.intermediate_size = required<int64_t>(j, "intermediate_size", what);
  c.num_hidden_layers = required<int64_t>(j, "num_hidden_layers", what);
  c.num_attention_heads = required<int64_t>(j, "num_attention_heads", what);
  c.num_key_value_heads = optional<int64_t>(j, "num_key_value_heads", c.num_attention_heads, what);
  c.head_dim = optional<int64_t>(j, "head_dim", c.hidden_size / c.num_attention_heads, what);
  c.max_position_embeddings = optional<int64_t>(j, "max_position_embeddings", 4096, what);
  c.rms_norm_eps = optional<double>(j, "rms_norm_eps", family->default_rms_norm_eps, what);
  c.tie_word_embeddings = optional<bool>(j, "tie_word_embeddings", false, what);
  c.attention_bias = optional<bool>(j, "attention_bias", family->default_attention_bias, what);
  c.mlp_bias = optional<bool>(j, "mlp_bias", false, what);
  family->read_config(j, c, what);  // its own fields and building blocks
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

// A model family: what one HuggingFace model_type's config.json says beyond
// the fields every preset reads (hf_config.cpp), and so which building
// blocks its decoder layers use (decoder_layer.h: q/k norms, sliding
// windows, experts, router bias, attention sinks). One file per family
// (qwen3.cpp, qwen3_moe.cpp, llama.cpp, gpt_oss.cpp), each with its test
// (tests/models/families/); a new family is a new file, its line in
// model_families() (hf_config.cpp) and its test. Internal header.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "roundpipe/models/config.h"

namespace roundpipe::models::detail {

struct ModelFamily {
  std::string model_type;  // config.json's, e.g. "qwen3"
  // Defaults of the common fields where the family's differ.
  double default_rms_norm_eps = 1e-6;
  bool default_attention_bias = false;
  // Reads the family's own fields into `c` (its common fields are read):
  // errors name `what` (the file) and the field.
  void (*read_config)(const nlohmann::json& j, CausalLMConfig& c,
                      const std::string& what) = nullptr;
};

const ModelFamily& qwen3_family();
const ModelFamily& qwen3_moe_family();
const ModelFamily& llama_family();
const ModelFamily& gpt_oss_family();

// Every family the presets implement (hf_config.cpp), and the one of
// `model_type` (nullptr: none).
const std::vector<const ModelFamily*>& model_families();
const ModelFamily* find_model_family(const std::string& model_type);

// Qwen3's sliding windows (qwen3.cpp), which Qwen3-MoE reads the same way.
void read_qwen3_attention_windows(const nlohmann::json& j, CausalLMConfig& c,
                                  const std::string& what);

}  // namespace roundpipe::models::detail

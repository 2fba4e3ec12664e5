// config.json text for the families' tests: the common fields of a small
// model, and the error a config gives.
#pragma once

#include <c10/util/Exception.h>

#include <string>

#include "roundpipe/models/config.h"

namespace roundpipe::testing {

// A small config of `model_type` with `extra` fields (",\"key\":value...").
inline std::string small_config(const std::string& model_type, const std::string& extra = "") {
  return R"({"model_type":")" + model_type +
         R"(","vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":4,
            "num_attention_heads":2)" +
         extra + "}";
}

inline models::CausalLMConfig read_config(const std::string& json) {
  return models::CausalLMConfig::from_json_string(json, "config.json");
}

// The error a config gives, or "(accepted)".
inline std::string config_error(const std::string& json) {
  try {
    read_config(json);
    return "(accepted)";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
}

}  // namespace roundpipe::testing

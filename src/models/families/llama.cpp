// Llama 3.x (model_type "llama"): the decoder every preset builds on
// (grouped-query attention, rotary embeddings with llama3 or yarn scaling,
// a SwiGLU MLP), with nothing of its own beyond the common fields
// (hf_config.cpp): no q/k norms, no sliding windows, no experts.
#include "models/families/family.h"

namespace roundpipe::models::detail {
namespace {

void read_llama(const nlohmann::json&, CausalLMConfig&, const std::string&) {}

}  // namespace

const ModelFamily& llama_family() {
  static const ModelFamily family{"llama", 1e-6, false, read_llama};
  return family;
}

}  // namespace roundpipe::models::detail

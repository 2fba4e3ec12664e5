// The transformers reference the preset tests compare with
// (tests/models/hf_reference.py): where it lives, its cases and inputs, and
// the tolerance. Test-only header.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/safetensors.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace roundpipe::testing {

// fp32 against transformers: the same products summed in another order
// (matmul blocking, attention over a sequence's own keys instead of a
// masked row of the whole batch's), a few ulps of each tensor's largest
// element; 1e-4 leaves room for the 3-layer model's growth of them.
constexpr double kTol = 1e-4;

inline std::string file_text(const std::filesystem::path& path) {
  std::ifstream file(path);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

// Made by transformers (tests/models/hf_reference.py) once per build tree
// and shared by the test processes: CTest runs each test in a process of
// its own, and making it takes ~25 s. The first process makes it under a
// file lock while the others wait; it is made again when the script or the
// Python changes (its stamp).
inline const std::filesystem::path& reference_root() {
  static const std::filesystem::path root = [] {
    const std::filesystem::path dir = std::filesystem::path(ROUNDPIPE_BINARY_DIR) / "hf_reference";
    const std::string script = std::string(ROUNDPIPE_SOURCE_DIR) + "/tests/models/hf_reference.py";
    const std::string stamp =
        std::to_string(std::hash<std::string>{}(file_text(script) + ROUNDPIPE_PYTHON));
    const std::string lock_path = dir.string() + ".lock";
    const int lock = ::open(lock_path.c_str(), O_CREAT | O_RDWR, 0644);
    if (lock < 0 || ::flock(lock, LOCK_EX) != 0)
      ADD_FAILURE() << "cannot lock " << lock_path << ": " << std::strerror(errno);
    if (file_text(dir / "stamp") != stamp) {
      std::filesystem::remove_all(dir);
      const std::string cmd = std::string(ROUNDPIPE_PYTHON) + " " + script + " make " +
                              dir.string() + " > " + dir.string() + ".log 2>&1";
      if (std::system(cmd.c_str()) == 0) {
        std::ofstream(dir / "stamp") << stamp;
      } else {
        ADD_FAILURE() << "could not make the transformers reference (is transformers==5.17.0 "
                         "installed? scripts/setup.sh installs it):\n"
                      << file_text(dir.string() + ".log");
      }
    }
    if (lock >= 0) ::close(lock);  // releases the lock
    return dir;
  }();
  return root;
}

// The reference cases of hf_reference.py, by their inputs.
inline const std::vector<std::string> kCases = {"qwen3",
                                                "qwen3_tied_padded",
                                                "llama_padded",
                                                "llama31_tied",
                                                "qwen3_left_padded",
                                                "llama31_left_padded",
                                                "qwen3_packed",
                                                "llama_packed",
                                                "qwen3_sliding",
                                                "qwen3_sliding_left",
                                                "qwen3_sliding_packed",
                                                "qwen3_moe_padded",
                                                "qwen3_moe_packed",
                                                "qwen3_moe_router_loss",
                                                "qwen3_moe_router_loss_packed",
                                                "gpt_oss_left_padded",
                                                "gpt_oss_router_loss"};

inline bool has_router_loss(const std::string& name) {
  return name.find("router_loss") != std::string::npos;
}

inline at::Tensor maybe(const safetensors::File& ref, const std::string& name) {
  for (const auto& [n, t] : ref.tensors) {
    if (n == name) return t;
  }
  return {};
}

inline models::CausalLMInput reference_input(const safetensors::File& ref) {
  models::CausalLMInput in;
  in.input_ids = ref.get("input_ids");
  in.attention_mask = maybe(ref, "attention_mask");
  in.position_ids = maybe(ref, "position_ids");
  in.labels = ref.get("labels");
  return in;
}

inline c10::IValue model_input(const safetensors::File& ref) {
  return reference_input(ref).to_ivalue();
}

// Logits where there is a token: at padding positions attention is zero
// here, as in transformers' flash_attention_2, but not in its sdpa path
// (models/attention.h).
inline at::Tensor token_logits(const at::Tensor& logits, const safetensors::File& ref) {
  const auto mask = maybe(ref, "attention_mask");
  return mask.defined() ? logits.index({mask.to(at::kBool)}) : logits;
}

inline void expect_grads(const models::CausalLM& model, const safetensors::File& ref) {
  for (const auto& [name, p] : model.hf_state_dict()) {
    EXPECT_TENSOR_NEAR(p.grad(), ref.get("grad." + name), kTol, "gradient of " << name);
  }
}

}  // namespace roundpipe::testing

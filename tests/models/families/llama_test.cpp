// The Llama family (src/models/families/llama.cpp): the common decoder with
// nothing of its own. Its numerics against transformers: the "llama*"
// cases of causal_lm_test.cpp.
#include <gtest/gtest.h>

#include "models/families/family_test_util.h"

namespace roundpipe::testing {
namespace {

TEST(LlamaFamily, NoQueryKeyNormsWindowsOrExperts) {
  // (Qwen3's window fields mean nothing to Llama.)
  const auto c = read_config(
      small_config("llama", R"(,"use_sliding_window":true,"sliding_window":4,"num_experts":4)"));
  EXPECT_FALSE(c.qk_norm);
  EXPECT_TRUE(c.attention_windows.empty());
  EXPECT_EQ(c.num_experts, 0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.attention_bias);
}

TEST(LlamaFamily, Llama3RotaryScaling) {
  const auto c = read_config(small_config("llama", R"(,"rope_theta":500000.0,
      "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
      "high_freq_factor":4.0,"original_max_position_embeddings":8192})"));
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
}

}  // namespace
}  // namespace roundpipe::testing

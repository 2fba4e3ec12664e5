// The Qwen3-MoE family (src/models/families/qwen3_moe.cpp): Qwen3's
// attention and a mixture of experts on its sparse layers. Its numerics
// against transformers: the "qwen3_moe*" cases of causal_lm_test.cpp.
#include <gtest/gtest.h>

#include "models/families/family_test_util.h"

namespace roundpipe::testing {
namespace {

TEST(Qwen3MoeFamily, ReadsItsExpertsAndWhichLayersAreSparse) {
  const auto c = read_config(small_config("qwen3_moe", R"(,"num_experts":8,
      "num_experts_per_tok":2,"moe_intermediate_size":4,"norm_topk_prob":true,
      "decoder_sparse_step":2,"mlp_only_layers":[3])"));
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 4);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.gpt_oss_experts);
  EXPECT_FALSE(c.router_bias);
  // (layer + 1) % 2 == 0 and not in mlp_only_layers: layer 1 only.
  EXPECT_FALSE(c.sparse_layer(0));
  EXPECT_TRUE(c.sparse_layer(1));
  EXPECT_FALSE(c.sparse_layer(2));
  EXPECT_FALSE(c.sparse_layer(3));
  EXPECT_FALSE(c.router_loss());
}

TEST(Qwen3MoeFamily, TransformersFivesNameOfTheExpertCountAndTheRouterLoss) {
  const auto c = read_config(small_config("qwen3_moe", R"(,"num_local_experts":4,
      "num_experts_per_tok":2,"output_router_logits":true,"router_aux_loss_coef":0.01)"));
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.moe_intermediate_size, 768);  // transformers' default
  EXPECT_TRUE(c.router_loss());
  EXPECT_DOUBLE_EQ(c.router_aux_loss_coef, 0.01);
  EXPECT_NE(config_error(small_config("qwen3_moe", R"(,"num_experts":4,"num_experts_per_tok":5)"))
                .find("num_experts_per_tok"),
            std::string::npos);
}

TEST(Qwen3MoeFamily, SlidingWindowsAsQwen3) {
  const auto c = read_config(small_config("qwen3_moe", R"(,"num_experts":4,"num_experts_per_tok":2,
      "use_sliding_window":true,"sliding_window":8,"max_window_layers":2)"));
  EXPECT_EQ(c.attention_windows, (std::vector<int64_t>{0, 0, 8, 8}));
}

}  // namespace
}  // namespace roundpipe::testing

// The GPT-OSS family (src/models/families/gpt_oss.cpp, Note [GPT-OSS]):
// its defaults, experts on every layer, sinks and alternate sliding
// windows. Its numerics against transformers: the "gpt_oss*" cases of
// causal_lm_test.cpp.
#include <gtest/gtest.h>

#include <set>

#include "models/families/family.h"
#include "models/families/family_test_util.h"

namespace roundpipe::testing {
namespace {

TEST(GptOssFamily, DefaultsExpertsSinksAndWindows) {
  const auto c = read_config(small_config("gpt_oss"));
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, c.intermediate_size);
  EXPECT_TRUE(c.norm_topk_prob && c.router_bias && c.gpt_oss_experts && c.attention_sinks);
  EXPECT_DOUBLE_EQ(c.swiglu_limit, 7.0);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) EXPECT_TRUE(c.sparse_layer(l)) << l;
  EXPECT_EQ(c.attention_windows, (std::vector<int64_t>{128, 0, 128, 0}));
}

TEST(GptOssFamily, ItsOwnFieldsOverrideTheDefaults) {
  const auto c = read_config(small_config("gpt_oss", R"(,"rms_norm_eps":1e-6,
      "attention_bias":false,"num_local_experts":8,"num_experts_per_tok":2,"sliding_window":16,
      "layer_types":["full_attention","sliding_attention","full_attention","full_attention"])"));
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.attention_windows, (std::vector<int64_t>{0, 16, 0, 0}));
  EXPECT_NE(
      config_error(small_config("gpt_oss", R"(,"num_local_experts":2,"num_experts_per_tok":3)"))
          .find("num_experts_per_tok must be in [1, num_local_experts]"),
      std::string::npos);
}

TEST(ModelFamilies, EachModelTypeHasOneFamilyAndAnUnknownOneIsNamed) {
  std::set<std::string> types;
  for (const auto* family : models::detail::model_families()) {
    EXPECT_TRUE(types.insert(family->model_type).second) << family->model_type;
    EXPECT_EQ(models::detail::find_model_family(family->model_type), family);
    EXPECT_EQ(read_config(small_config(family->model_type)).model_type, family->model_type);
  }
  EXPECT_EQ(types, (std::set<std::string>{"qwen3", "qwen3_moe", "llama", "gpt_oss"}));
  EXPECT_EQ(models::detail::find_model_family("gpt2"), nullptr);
  EXPECT_NE(config_error(R"({"model_type":"gpt2"})")
                .find("supported presets: qwen3, qwen3_moe, llama, gpt_oss"),
            std::string::npos);
}

}  // namespace
}  // namespace roundpipe::testing

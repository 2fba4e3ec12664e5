// The Qwen3 family (src/models/families/qwen3.cpp): q/k norms and sliding
// windows as transformers reads them. Its numerics against transformers:
// the "qwen3*" cases of tests/models/causal_lm_test.cpp.
#include <gtest/gtest.h>

#include "models/families/family_test_util.h"

namespace roundpipe::testing {
namespace {

using Windows = std::vector<int64_t>;

TEST(Qwen3Family, NormsQueriesAndKeysWithCommonDefaults) {
  const auto c = read_config(small_config("qwen3"));
  EXPECT_TRUE(c.qk_norm);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.num_experts, 0);
  EXPECT_FALSE(c.attention_sinks);
}

TEST(Qwen3Family, SlidingWindowsOnlyWithUseSlidingWindow) {
  auto windows = [](const std::string& extra) {
    return read_config(small_config("qwen3", extra)).attention_windows;
  };
  EXPECT_EQ(windows(""), Windows{});
  // Without use_sliding_window there is no window, whatever else says so.
  EXPECT_EQ(windows(R"(,"sliding_window":4,"max_window_layers":1)"), Windows{});
  EXPECT_EQ(windows(R"(,"use_sliding_window":true,"sliding_window":4,"max_window_layers":1)"),
            (Windows{0, 4, 4, 4}));
  // An absent sliding_window is transformers' default, 4096.
  EXPECT_EQ(windows(R"(,"use_sliding_window":true,"max_window_layers":3)"),
            (Windows{0, 0, 0, 4096}));
  EXPECT_EQ(windows(R"(,"use_sliding_window":true,"sliding_window":4,
      "layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"])"),
            (Windows{4, 0, 4, 0}));
}

TEST(Qwen3Family, LayerTypesItCannotComputeAreErrors) {
  EXPECT_NE(config_error(small_config("qwen3", R"(,"use_sliding_window":true,"sliding_window":4,
      "layer_types":["full_attention","chunked_attention","full_attention","full_attention"])"))
                .find("layer type 'chunked_attention'"),
            std::string::npos);
  EXPECT_NE(config_error(small_config("qwen3", R"(,"use_sliding_window":true,"sliding_window":4,
      "layer_types":["full_attention"])"))
                .find("layer_types has 1 entries for 4 layers"),
            std::string::npos);
  EXPECT_NE(config_error(small_config("qwen3", R"(,"use_sliding_window":true,"sliding_window":-2)"))
                .find("sliding_window must be positive"),
            std::string::npos);
}

}  // namespace
}  // namespace roundpipe::testing

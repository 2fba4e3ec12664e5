// A stage job's measured intervals as per-layer samples
// (runtime/stage_timer.h), checked without devices.
#include "runtime/stage/stage_timer.h"

#include <gtest/gtest.h>

namespace roundpipe::testing {
namespace {

using detail::LayerTimings;
using detail::TimedInterval;

TEST(StageTimer, ChunksOfOneMicrobatchAddUpToOneSamplePerLayerAndKind) {
  const std::vector<TimedInterval> measured = {{3, LayerTimings::kRecompute, 1.0},
                                               {3, LayerTimings::kBackward, 2.0},
                                               {3, LayerTimings::kRecompute, 0.5},
                                               {3, LayerTimings::kBackward, 1.5},
                                               {2, LayerTimings::kForward, 0.25}};
  const auto times = detail::per_layer_times(measured, {2, 4});
  ASSERT_EQ(times.size(), 3u);
  EXPECT_DOUBLE_EQ(times.at({3, LayerTimings::kRecompute}), 1.5);
  EXPECT_DOUBLE_EQ(times.at({3, LayerTimings::kBackward}), 3.5);
  EXPECT_DOUBLE_EQ(times.at({2, LayerTimings::kForward}), 0.25);
}

TEST(StageTimer, ASharedBackwardGoesToItsLayersInProportionToTheirForwardSide) {
  // Layers 4..6 recomputed in 1, 3 and 0 s (layer 6: forward 0 s), one
  // backward of 8 s through 5..6 (layer 4 has its own).
  const std::vector<TimedInterval> measured = {{4, LayerTimings::kRecompute, 1.0},
                                               {5, LayerTimings::kRecompute, 3.0},
                                               {6, LayerTimings::kRecompute, 1.0},
                                               {-1, LayerTimings::kBackward, 8.0},
                                               {4, LayerTimings::kBackward, 2.0}};
  const auto times = detail::per_layer_times(measured, {5, 7});
  EXPECT_DOUBLE_EQ(times.at({5, LayerTimings::kBackward}), 6.0);
  EXPECT_DOUBLE_EQ(times.at({6, LayerTimings::kBackward}), 2.0);
  EXPECT_DOUBLE_EQ(times.at({4, LayerTimings::kBackward}), 2.0);  // its own, untouched
}

TEST(StageTimer, WithoutForwardTimesASharedBackwardIsSharedEvenly) {
  const std::vector<TimedInterval> measured = {{-1, LayerTimings::kBackward, 3.0},
                                               {-1, LayerTimings::kBackward, 3.0}};
  const auto times = detail::per_layer_times(measured, {0, 3});
  ASSERT_EQ(times.size(), 3u);
  for (int l = 0; l < 3; ++l) EXPECT_DOUBLE_EQ(times.at({l, LayerTimings::kBackward}), 2.0);
}

TEST(StageTimer, NoSharedBackwardNoShares) {
  const auto times = detail::per_layer_times({{1, LayerTimings::kForward, 1.0}}, {0, 3});
  ASSERT_EQ(times.size(), 1u);
  EXPECT_FALSE(times.count({0, LayerTimings::kBackward}));
}

}  // namespace
}  // namespace roundpipe::testing

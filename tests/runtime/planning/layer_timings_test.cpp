// Measured per-layer times (runtime/layer_timings.h): the first sample of
// each kind is dropped as warm-up, later ones are smoothed with rate 0.9 and
// bias correction (so a constant time is reported exactly); a layer counts
// as measured once it has a forward-side and a backward time; what a layer
// keeps for its backward follows its largest output.
#include "runtime/planning/layer_timings.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>

namespace roundpipe::testing {
namespace {

using detail::LayerTimings;

// A few double roundings per smoothing step (1 - 0.9 itself is exact):
// eight unit roundoffs per step, plus the pow and the division, of `x`.
double smoothing_tolerance(double x, int steps) {
  return 8.0 * (steps + 2) * 1.2e-16 * x;
}

TEST(LayerTimings, TheFirstSampleIsDroppedAndAConstantIsReportedExactly) {
  LayerTimings timings(1);
  timings.add(0, LayerTimings::kForward, 100.0);  // warm-up: dropped
  for (int i = 0; i < 5; ++i) timings.add(0, LayerTimings::kForward, 2.0);
  timings.add(0, LayerTimings::kBackward, 100.0);
  timings.add(0, LayerTimings::kBackward, 3.0);
  const auto costs = timings.costs({10}, {4});
  ASSERT_EQ(costs.size(), 1u);
  EXPECT_NEAR(costs[0].forward, 2.0, smoothing_tolerance(2.0, 5));
  EXPECT_NEAR(costs[0].backward, 3.0, smoothing_tolerance(3.0, 1));
  EXPECT_EQ(costs[0].param_bytes, 10);
  EXPECT_EQ(costs[0].grad_bytes, 4);
}

TEST(LayerTimings, SmoothingWeighsRecentSamplesWithBiasCorrection) {
  LayerTimings timings(1);
  const std::vector<double> samples = {9.0, 1.0, 2.0, 4.0};  // the first is warm-up
  for (double s : samples) timings.add(0, LayerTimings::kRecompute, s);
  timings.add(0, LayerTimings::kBackward, 0.0);
  timings.add(0, LayerTimings::kBackward, 1.0);
  // Exponential average with rate 0.9 over 1, 2, 4, divided by 1 - 0.9^3.
  double average = 0;
  for (size_t i = 1; i < samples.size(); ++i) average = 0.9 * average + 0.1 * samples[i];
  const double expected = average / (1 - std::pow(0.9, 3));
  const auto costs = timings.costs({0}, {0});
  EXPECT_NEAR(costs[0].recompute, expected, smoothing_tolerance(expected, 3));
  // A layer seen only with grad (a fused tail's) lends its recompute time
  // to its forward.
  EXPECT_EQ(costs[0].forward, costs[0].recompute);
}

TEST(LayerTimings, CompleteOnceEveryLayerHasForwardAndBackwardTimes) {
  LayerTimings timings(2);
  EXPECT_FALSE(timings.complete());
  for (int l = 0; l < 2; ++l) {
    timings.add(l, LayerTimings::kForward, 1.0);  // one sample: warm-up only
    timings.add(l, LayerTimings::kBackward, 1.0);
  }
  EXPECT_FALSE(timings.complete());
  for (int l = 0; l < 2; ++l) timings.add(l, LayerTimings::kForward, 1.0);
  EXPECT_FALSE(timings.complete());  // no backward beyond warm-up
  timings.add(0, LayerTimings::kBackward, 1.0);
  EXPECT_FALSE(timings.complete());  // layer 1 still lacks one
  timings.add(1, LayerTimings::kBackward, 1.0);
  EXPECT_TRUE(timings.complete());
}

TEST(LayerTimings, KeptBytesFollowTheLargestOutputAndAreAtLeastTheOutput) {
  LayerTimings timings(2);
  EXPECT_TRUE(timings.wants_kept_bytes(0));
  // The first metered forward is dropped (it holds one-off workspaces).
  timings.add_kept_bytes(0, 1000, 1000, 100);
  timings.add_kept_bytes(0, 300, 300, 100);  // keeps 3 x its output
  timings.add_kept_bytes(0, 200, 200, 100);  // less: the largest ratio stays
  EXPECT_FALSE(timings.wants_kept_bytes(0));
  timings.add_output_bytes(0, 100);
  timings.add_output_bytes(0, 50);  // the largest output counts
  timings.add_output_bytes(1, 64);  // never metered: its output at least
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[0].activation_bytes, 300);
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[1].activation_bytes, 64);
  // A longer sequence later: the estimate scales with the output.
  timings.add_output_bytes(0, 400);
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[0].activation_bytes, 1200);
}

// What a layer says it keeps whatever its rows (the fused loss's weight
// gradient) stays whole: the rest scales with the output, it does not.
TEST(LayerTimings, KeptBytesIndependentOfRowsDoNotScaleWithTheOutput) {
  LayerTimings timings(1);
  timings.add_kept_bytes(0, 5000, 5000, 100, 4000);  // dropped
  timings.add_kept_bytes(0, 4300, 4300, 100, 4000);  // 300 by rows: 3 x its output
  timings.add_output_bytes(0, 100);
  auto cost = timings.costs({0}, {0})[0];
  EXPECT_EQ(cost.activation_bytes, 4300);
  EXPECT_EQ(cost.activation_bytes_independent_of_rows, 4000);
  timings.add_output_bytes(0, 400);  // a longer sequence: 3 x 400, and the 4000
  cost = timings.costs({0}, {0})[0];
  EXPECT_EQ(cost.activation_bytes, 5200);
  EXPECT_EQ(cost.activation_bytes_independent_of_rows, 4000);
}

// Note [Working memory that does not follow the rows]: of a backward's
// working memory up to one gradient of the layer's parameters stays whole
// when the output grows; the rest scales with it; at the measured size the
// estimate is the measurement.
TEST(LayerTimings, WorkingBytesScaleButForOneGradientOfTheParameters) {
  LayerTimings timings(2);
  for (int l = 0; l < 2; ++l) {
    timings.add_output_bytes(l, 100);
    timings.add_kept_bytes(l, 100, 100, 100);  // (dropped)
    timings.add_kept_bytes(l, 100, 100, 100);
    timings.add_backward_bytes(l, 1000, /*after_a_first_backward=*/true);
  }
  // Layer 0's gradients are 800 bytes, layer 1's 5000 (more than measured).
  EXPECT_EQ(timings.costs({0, 0}, {800, 5000})[0].working_bytes, 1000);
  EXPECT_EQ(timings.costs({0, 0}, {800, 5000})[1].working_bytes, 1000);
  timings.add_output_bytes(0, 400);
  timings.add_output_bytes(1, 400);
  const auto costs = timings.costs({0, 0}, {800, 5000});
  EXPECT_EQ(costs[0].working_bytes, 800 + 200 * 4);  // was 1000 * 4
  EXPECT_EQ(costs[1].working_bytes, 1000);           // all of it a gradient's worth
}

// Working bytes: the most a forward held beyond what it kept, or a backward
// held; the largest ratio to the output, as kept bytes.
TEST(LayerTimings, WorkingBytesAreTheLargestPeakBeyondWhatIsKept) {
  LayerTimings timings(2);
  timings.add_output_bytes(0, 100);
  timings.add_output_bytes(1, 100);
  timings.add_kept_bytes(0, 900, 5000, 100);  // dropped (workspaces)
  timings.add_kept_bytes(0, 300, 500, 100);   // held 200 beyond the 300 it keeps
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[0].working_bytes, 200);
  EXPECT_TRUE(timings.wants_backward_bytes(0));
  // A frozen layer's first backward is metered, and dropped (workspaces).
  timings.add_backward_bytes(0, 9000, /*after_a_first_backward=*/false);
  timings.add_backward_bytes(0, 150, false);  // less than the forward's: stays 200
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[0].working_bytes, 200);
  timings.add_backward_bytes(0, 700, false);
  EXPECT_FALSE(timings.wants_backward_bytes(0));
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[0].working_bytes, 700);
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[1].working_bytes, 0);  // never metered
  timings.add_output_bytes(0, 200);                              // scales with the output
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[0].working_bytes, 1400);
}

// Note [Backward working memory]: a trainable layer's first backward runs
// unmetered (it allocates the gradients), so its first metered one counts;
// the memory counts as measured once every layer has both what it keeps
// and its backward's working memory.
TEST(LayerTimings, ATrainableLayersFirstMeteredBackwardCountsAndCompletesTheMemory) {
  LayerTimings timings(2);
  for (int l = 0; l < 2; ++l) {
    timings.add_output_bytes(l, 100);
    timings.add_kept_bytes(l, 900, 900, 100);  // dropped
    timings.add_kept_bytes(l, 300, 400, 100);
  }
  EXPECT_FALSE(timings.memory_measured()) << "no backward measured";
  timings.add_backward_bytes(0, 1000, /*after_a_first_backward=*/true);
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[0].working_bytes, 1000);
  EXPECT_FALSE(timings.memory_measured()) << "layer 1's backward is not";
  timings.add_backward_bytes(1, 1000, /*after_a_first_backward=*/false);  // dropped
  EXPECT_FALSE(timings.memory_measured());
  timings.add_backward_bytes(1, 500, false);
  EXPECT_TRUE(timings.memory_measured());
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[1].working_bytes, 500);
}

// Note [One microbatch a call]: a backward that allocated the gradients
// (after the first, a warm-up), with the gradient it received and its
// input (the layer before's output), stands for the working memory only
// where asked, and only until a backward after one is measured.
TEST(LayerTimings, FirstBackwardsStandInOnlyWhereAskedAndUntilALaterOneIsMeasured) {
  LayerTimings timings(2);
  timings.add_output_bytes(0, 50);
  timings.add_output_bytes(1, 100);
  for (int l = 0; l < 2; ++l) {
    timings.add_kept_bytes(l, 900, 900, l == 0 ? 50 : 100);  // dropped
    timings.add_kept_bytes(l, 300, 400, l == 0 ? 50 : 100);  // forward working: 100
  }
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(timings.wants_first_backward_bytes(l));
    timings.add_first_backward_bytes(l, 9000, 0);  // dropped (workspaces)
  }
  EXPECT_FALSE(timings.memory_measured(/*first_backwards_stand_in=*/true));
  timings.add_first_backward_bytes(0, 200, 20);  // 200 + 20, no input before layer 0
  timings.add_first_backward_bytes(1, 400, 30);  // 400 + 30 + layer 0's 50
  EXPECT_FALSE(timings.memory_measured()) << "no backward after one measured";
  EXPECT_TRUE(timings.memory_measured(true));
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[1].working_bytes, 100);
  EXPECT_EQ(timings.costs({0, 0}, {0, 0}, true)[0].working_bytes, 220);
  EXPECT_EQ(timings.costs({0, 0}, {0, 0}, true)[1].working_bytes, 480);
  timings.add_output_bytes(1, 200);  // scales with the output, as any sample
  EXPECT_EQ(timings.costs({0, 0}, {0, 0}, true)[1].working_bytes, 960);
  // A backward after one (300 at the output of 200): the measurement,
  // whatever was asked.
  timings.add_backward_bytes(1, 300, /*after_a_first_backward=*/true);
  EXPECT_FALSE(timings.wants_first_backward_bytes(1));
  EXPECT_EQ(timings.costs({0, 0}, {0, 0}, true)[1].working_bytes, 300);
  EXPECT_EQ(timings.costs({0, 0}, {0, 0})[1].working_bytes, 300);
}

TEST(LayerTimings, CostsNeedOneSizePerLayer) {
  LayerTimings timings(2);
  EXPECT_THROW(timings.costs({1}, {1}), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing

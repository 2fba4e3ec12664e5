// The engine's automatic plan (runtime/engine/auto_plan.h) built on its own
// parts, as Engine's constructor wires them: without a model_memory_limit
// it plans under what a simulated device's budget leaves (less a tenth),
// with more stages than without one and every stage within the limit by
// its own estimate; after a call runs out of memory
// (shrink_after_out_of_memory) the next plans are smaller: under three
// quarters of the limit, or, without a limit, with a stage more than the
// plan that failed. The oracle of "fits" is the plan's own predicted
// peaks; the limits come from smallest_feasible_memory_limit (planner.h).
#include "runtime/engine/auto_plan.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <memory>
#include <string>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

using detail::AutoPlan;

constexpr int kLayers = 6;
constexpr int kMicrobatches = 2;

// Six Linear(24, 24): 2400 bytes of parameters each.
torch::nn::Sequential six_linears() {
  torch::manual_seed(3);
  torch::nn::Sequential model;
  for (int l = 0; l < kLayers; ++l) model->push_back(torch::nn::Linear(24, 24));
  return model;
}

// An AutoPlan over a fresh model on the devices of `spec`.
struct Planning {
  std::string name = "plan test";
  RoundPipeOptions options;
  std::vector<LayerPtr> layers = layers_of(six_linears());
  DevicePool pool;
  detail::WeightTable weights;
  detail::LayerTimings timings{kLayers};
  detail::CommitLedger commits;
  AutoPlan plan;

  explicit Planning(const std::string& spec)
      : pool(make_devices(spec)),
        weights(layers, options.pin_model, pool.at(0)->supports_pinned_memory(), name),
        plan(name, options, pool, layers, weights, timings, commits) {}

  // The plan of a training forward (`fused`: a forward_backward) in layer
  // grain (the grain of calls before any layer is measured), without a
  // caller's constraints. (Under a limit, a forward_backward before the
  // measurement runs one layer per stage: Note [First training call].)
  PlanEstimate estimate(bool fused = false) const {
    return plan.estimate(fused, kMicrobatches, 0, std::nullopt, RecomputeGrain::kLayer);
  }
  // The smallest limit at which the planner finds a plan for it.
  int64_t smallest_feasible_limit() const {
    PlanRequest request;
    request.fused = true;
    request.num_microbatches = kMicrobatches;
    request.layer_grain = true;
    request.activations_unmeasured = true;  // no layer timed yet
    return smallest_feasible_memory_limit(
        costs_from_bytes(weights.layer_bytes(), weights.layer_grad_bytes()), request);
  }
};

int stage_count(const ExecutePlan& plan) {
  return static_cast<int>(plan.forward.size() + plan.backward.size());
}

// About `bytes`, rounded down to a multiple of 36 (= 4 x 9: the limit a
// sim device of 10/9 that size leaves, and three quarters of it, are exact).
int64_t round_limit(int64_t bytes) {
  return bytes / 36 * 36;
}
// A sim device whose budget leaves a plan the limit `limit` (what the
// device has left, less a tenth).
std::string sim_with_limit(int64_t limit) {
  return "sim:1,mem=" + std::to_string(limit / 9 * 10);
}

// Until activations are measured the plan holds half the limit back for
// them: a stage fits when twice its peak does.
void expect_fits(const PlanEstimate& estimate, int64_t limit, const std::string& what,
                 bool fused = false) {
  ASSERT_FALSE(estimate.stages.empty()) << what;
  for (const auto& stage : estimate.stages) {
    EXPECT_LE(2 * stage.peak_bytes, limit)
        << what << ": layers " << stage.range.begin << ".." << stage.range.end << " of "
        << estimate.plan.to_string();
  }
  EXPECT_NO_THROW(estimate.plan.validate(kLayers, fused)) << what;
}

TEST(AutoPlan, ASimulatedDevicesBudgetLimitsThePlanWhichFitsItByItsOwnEstimate) {
  const Planning unlimited("sim:1");
  const auto free = unlimited.estimate();
  const int64_t limit = round_limit(unlimited.smallest_feasible_limit() * 3 / 2);
  // The limit binds: the plan without one does not fit it.
  ASSERT_GT(2 * free.largest_peak_bytes(), limit) << free.describe();
  const Planning limited(sim_with_limit(limit));
  ASSERT_EQ(limited.pool.at(0)->memory_stats().in_use_bytes, 0);
  const auto tight = limited.estimate();
  expect_fits(tight, limit, "limited by the device");
  EXPECT_GT(tight.stages.size(), free.stages.size()) << tight.describe() << free.describe();
  // A caller's limit overrides the device's: the unlimited pool's plan
  // under the same limit is the same plan.
  const auto asked = unlimited.plan.estimate(
      false, kMicrobatches, 0, static_cast<double>(limit) / (1 << 30), RecomputeGrain::kLayer);
  EXPECT_EQ(asked.plan.to_string(), tight.plan.to_string());
}

// Note [First training call]: before what layers keep for their backward is
// measured, a forward_backward under a device's limit packs its stages into
// a quarter of the limit (three quarters for activations); a caller's own
// limit gets the usual half.
TEST(AutoPlan, BeforeMeasurementAForwardBackwardUnderALimitKeepsThreeQuartersForActivations) {
  const Planning unlimited("sim:1");
  const int64_t limit = round_limit(unlimited.smallest_feasible_limit() * 3);
  const Planning limited(sim_with_limit(limit));
  const auto first = limited.estimate(/*fused=*/true);
  for (const auto& stage : first.stages) EXPECT_LE(4 * stage.peak_bytes, limit) << first.describe();
  const auto asked = unlimited.plan.estimate(
      true, kMicrobatches, 0, static_cast<double>(limit) / (1 << 30), RecomputeGrain::kLayer);
  expect_fits(asked, limit, "a caller's limit", /*fused=*/true);
  ASSERT_GT(4 * asked.largest_peak_bytes(), limit) << "the quarter would change nothing";
  EXPECT_GT(stage_count(first.plan), stage_count(asked.plan)) << first.describe() << "\n"
                                                              << asked.describe();
  // Where a quarter holds no plan (one layer per stage needs more than
  // it), the first call's plan is packed into half, as any unmeasured one.
  const int64_t tight = round_limit(unlimited.smallest_feasible_limit() * 5 / 4);
  const Planning small(sim_with_limit(tight));
  expect_fits(small.estimate(/*fused=*/true), tight, "a tight limit", /*fused=*/true);
}

TEST(AutoPlan, AfterRunningOutOfMemoryThePlansFitThreeQuartersOfTheLimit) {
  int64_t limit = 0;
  {
    const Planning probe("sim:1");
    limit = round_limit(probe.smallest_feasible_limit() * 3);  // room to shrink
  }
  Planning planning(sim_with_limit(limit));
  const auto before = planning.estimate();
  expect_fits(before, limit, "before");
  ASSERT_GT(2 * before.largest_peak_bytes(), limit * 3 / 4) << "the shrink would change nothing";
  const auto failed = planning.plan.for_call(false, kMicrobatches, RecomputeGrain::kLayer).plan;
  EXPECT_EQ(failed.to_string(), before.plan.to_string());
  // The caller chose the grain: it stays, the limit shrinks.
  planning.plan.shrink_after_out_of_memory(failed, RecomputeGrain::kLayer, /*grain_chosen=*/false);
  const auto after = planning.estimate();
  expect_fits(after, limit * 3 / 4, "after one shrink");
  EXPECT_GE(after.stages.size(), before.stages.size());
  EXPECT_NE(after.plan.to_string(), before.plan.to_string());
  const auto next = planning.plan.for_call(false, kMicrobatches, RecomputeGrain::kLayer);
  EXPECT_EQ(next.plan.to_string(), after.plan.to_string());
  EXPECT_EQ(next.grain, RecomputeGrain::kLayer);
  // A caller's own limit is not shrunk.
  const auto asked = planning.plan.estimate(
      false, kMicrobatches, 0, static_cast<double>(limit) / (1 << 30), RecomputeGrain::kLayer);
  EXPECT_EQ(asked.plan.to_string(), before.plan.to_string());
}

// Note [Host room for checkpoints]: where the plan chooses layer grain (here
// after a stage-grain call ran out of memory) and its checkpoints, every
// layer's input, would take more than the host's room for them, calls run
// in layer-from-stage grain, and stay there.
TEST(AutoPlan, WhereTheHostHasNoRoomForLayerGrainsCheckpointsCallsKeepStageInputsOnly) {
  const Planning probe("sim:1");
  Planning planning(sim_with_limit(round_limit(probe.smallest_feasible_limit())));
  // Every layer measured: 1 ms each way, 1000-byte outputs.
  for (int l = 0; l < kLayers; ++l) {
    for (auto kind : {detail::LayerTimings::kForward, detail::LayerTimings::kRecompute,
                      detail::LayerTimings::kBackward}) {
      planning.timings.add(l, kind, 1e-3);
      planning.timings.add(l, kind, 1e-3);
    }
    planning.timings.add_output_bytes(l, 1000);
    planning.timings.add_kept_bytes(l, 1000, 1000, 1000);  // dropped
    planning.timings.add_kept_bytes(l, 1000, 1000, 1000);
    planning.timings.add_backward_bytes(l, 500, /*after_a_first_backward=*/true);
  }
  ASSERT_TRUE(planning.timings.complete());
  ASSERT_TRUE(planning.timings.memory_measured());
  const auto failed = planning.plan.for_call(true, kMicrobatches, std::nullopt).plan;
  planning.plan.shrink_after_out_of_memory(failed, RecomputeGrain::kStage, /*grain_chosen=*/true);
  planning.options.host_checkpoint_limit_gib = 1024;  // room
  auto roomy = planning.plan.for_call(true, kMicrobatches, std::nullopt);
  ASSERT_EQ(roomy.grain, RecomputeGrain::kLayer);
  // Layer grain keeps the inputs of the layers of the backward stages
  // after the tail (if none, this test has nothing to show).
  int kept_layers = 0;
  for (size_t i = 1; i < roomy.plan.backward.size(); ++i)
    kept_layers += roomy.plan.backward[i].size() - (roomy.plan.backward[i].begin == 0 ? 1 : 0);
  ASSERT_GT(kept_layers, 0) << roomy.plan.to_string();
  planning.options.host_checkpoint_limit_gib = 1000.0 * kMicrobatches * kept_layers / 2 / (1 << 30);
  const auto short_of_room = planning.plan.for_call(true, kMicrobatches, std::nullopt);
  EXPECT_EQ(short_of_room.grain, RecomputeGrain::kLayerFromStage);
  // Measured: the backward stages' reruns keep their inputs on the device,
  // which the plan counted (Note [Thin checkpoints]); before any
  // measurement, on the host.
  EXPECT_TRUE(short_of_room.rerun_inputs_on_device);
  EXPECT_FALSE(Planning(sim_with_limit(round_limit(probe.smallest_feasible_limit())))
                   .plan.for_call(true, kMicrobatches, RecomputeGrain::kLayerFromStage)
                   .rerun_inputs_on_device);
  EXPECT_NO_THROW(short_of_room.plan.validate(kLayers, true));
  planning.options.host_checkpoint_limit_gib = 1024;
  EXPECT_EQ(planning.plan.for_call(true, kMicrobatches, std::nullopt).grain,
            RecomputeGrain::kLayerFromStage)
      << "the grain flips back once the room its checkpoints left is there";
  // A caller's grain is the caller's.
  EXPECT_EQ(planning.plan.for_call(true, kMicrobatches, RecomputeGrain::kLayer).grain,
            RecomputeGrain::kLayer);
}

TEST(AutoPlan, WithoutALimitThePlanAfterRunningOutOfMemoryHasAStageMore) {
  Planning planning("sim:1");
  const auto failed = planning.plan.for_call(true, kMicrobatches, RecomputeGrain::kLayer).plan;
  ASSERT_LT(stage_count(failed), 2 * kLayers - 1) << "already one layer per stage";
  planning.plan.shrink_after_out_of_memory(failed, RecomputeGrain::kLayer, false);
  const auto next = planning.plan.for_call(true, kMicrobatches, RecomputeGrain::kLayer).plan;
  EXPECT_GT(stage_count(next), stage_count(failed))
      << failed.to_string() << " then " << next.to_string();
  EXPECT_NO_THROW(next.validate(kLayers, true));
}

}  // namespace
}  // namespace roundpipe::testing

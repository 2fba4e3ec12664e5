// The schedule as data (runtime/schedule.h), checked without devices: which
// jobs a call runs, in which order, on which device (the way pipeline
// schedules are tested in DeepSpeed: the schedule is a list, not a run).
#include "runtime/planning/schedule.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <map>

namespace roundpipe::testing {
namespace {

using detail::CallPhase;
using detail::JobKind;
using detail::ScheduledJob;

ScheduledJob job(JobKind kind, int begin, int end, int stage, int device, int replica = 0,
                 int replicas = 1) {
  ScheduledJob j;
  j.kind = kind;
  j.range = {begin, end};
  j.stage_index = stage;
  j.device = device;
  j.replica = replica;
  j.replicas = replicas;
  return j;
}

std::string text(const std::vector<ScheduledJob>& jobs) {
  std::string out;
  for (const auto& j : jobs) out += j.describe() + " on device " + std::to_string(j.device) + "; ";
  return out;
}

// Layers 0..7: forward stages [0,3) [3,6), the fused tail [6,8), backward
// stages [3,6) [0,3) (deep first).
ExecutePlan fused_plan() {
  return ExecutePlan({{0, 3}, {3, 6}}, {{6, 8}, {3, 6}, {0, 3}});
}

TEST(Schedule, FusedCallRunsForwardTailBackwardOnConsecutiveTurns) {
  const auto jobs = detail::schedule_call(fused_plan(), CallPhase::kFused, 2, 0, 4);
  const std::vector<ScheduledJob> expected = {
      job(JobKind::kForward, 0, 3, 0, 0), job(JobKind::kForward, 3, 6, 1, 1),
      job(JobKind::kTail, 6, 8, 0, 0), job(JobKind::kBackward, 3, 6, 1, 1),
      job(JobKind::kBackward, 0, 3, 2, 0)};
  EXPECT_EQ(jobs, expected) << text(jobs);
  const auto per_device = detail::jobs_per_device(jobs, 2);
  ASSERT_EQ(per_device.size(), 2u);
  EXPECT_EQ(per_device[0], (std::vector<ScheduledJob>{expected[0], expected[2], expected[4]}));
  EXPECT_EQ(per_device[1], (std::vector<ScheduledJob>{expected[1], expected[3]}));
}

TEST(Schedule, TheRoundRobinContinuesFromTheCallersTurn) {
  // Three devices, this call's first turn on device 2.
  const auto jobs = detail::schedule_call(fused_plan(), CallPhase::kFused, 3, 2, 4);
  std::vector<int> devices;
  for (const auto& j : jobs) devices.push_back(j.device);
  EXPECT_EQ(devices, (std::vector<int>{2, 0, 1, 2, 0})) << text(jobs);
}

TEST(Schedule, AReplicatedTailTakesConsecutiveDevicesAndSharesTheMicrobatches) {
  ExecutePlan whole({}, {{0, 4}});
  whole.tail_replicas = 2;
  auto jobs = detail::schedule_call(whole, CallPhase::kFused, 3, 2, 4);
  EXPECT_EQ(jobs, (std::vector<ScheduledJob>{job(JobKind::kTail, 0, 4, 0, 2, 0, 2),
                                             job(JobKind::kTail, 0, 4, 0, 0, 1, 2)}))
      << text(jobs);
  // Never more replicas than microbatches.
  jobs = detail::schedule_call(whole, CallPhase::kFused, 3, 0, 1);
  EXPECT_EQ(jobs, (std::vector<ScheduledJob>{job(JobKind::kTail, 0, 4, 0, 0)})) << text(jobs);
}

TEST(Schedule, ForwardCallsAndTheirLaterBackward) {
  ExecutePlan plan({{0, 2}, {2, 4}}, {{2, 4}, {0, 2}});
  auto forward = detail::schedule_call(plan, CallPhase::kForward, 3, 1, 2);
  EXPECT_EQ(forward, (std::vector<ScheduledJob>{job(JobKind::kForward, 0, 2, 0, 1),
                                                job(JobKind::kForward, 2, 4, 1, 2)}))
      << text(forward);
  auto backward = detail::schedule_call(plan, CallPhase::kBackward, 3, 0, 2);
  EXPECT_EQ(backward, (std::vector<ScheduledJob>{job(JobKind::kBackward, 2, 4, 0, 0),
                                                 job(JobKind::kBackward, 0, 2, 1, 1)}))
      << text(backward);
}

// Over many plans: in a fused call every layer runs forward exactly once
// (a forward stage or the tail) and backward exactly once (the tail or a
// backward stage), and the jobs take consecutive turns.
TEST(Schedule, EveryLayerRunsOnceEachWayOnConsecutiveTurns) {
  for (int layers : {1, 2, 5, 9}) {
    for (int tail = 1; tail <= layers; ++tail) {
      for (int devices : {1, 2, 3}) {
        for (int replicas : {1, 2}) {
          // Forward stages of one layer before a tail of `tail` layers;
          // backward stages of two layers.
          ExecutePlan plan;
          for (int l = 0; l < layers - tail; ++l) plan.forward.push_back({l, l + 1});
          plan.backward.push_back({layers - tail, layers});
          for (int end = layers - tail; end > 0; end -= 2)
            plan.backward.push_back({std::max(0, end - 2), end});
          plan.tail_replicas = tail == layers ? replicas : 1;
          const int first = layers % devices;
          const auto jobs = detail::schedule_call(plan, CallPhase::kFused, devices, first, 4);
          std::map<int, int> forward_runs, backward_runs;
          for (size_t i = 0; i < jobs.size(); ++i) {
            const auto& j = jobs[i];
            EXPECT_EQ(j.device, (first + static_cast<int>(i)) % devices);
            if (j.replica > 0) continue;  // replicas share one stage's microbatches
            for (int l = j.range.begin; l < j.range.end; ++l) {
              if (j.kind != JobKind::kBackward) ++forward_runs[l];
              if (j.kind != JobKind::kForward) ++backward_runs[l];
            }
          }
          for (int l = 0; l < layers; ++l) {
            EXPECT_EQ(forward_runs[l], 1) << "layer " << l << ": " << text(jobs);
            EXPECT_EQ(backward_runs[l], 1) << "layer " << l << ": " << text(jobs);
          }
        }
      }
    }
  }
}

TEST(Schedule, BadArgumentsAreRefused) {
  EXPECT_THROW(detail::schedule_call(fused_plan(), CallPhase::kFused, 2, 2, 4), c10::Error);
  EXPECT_THROW(detail::schedule_call(fused_plan(), CallPhase::kFused, 0, 0, 4), c10::Error);
  EXPECT_THROW(detail::schedule_call(ExecutePlan({{0, 2}}, {}), CallPhase::kFused, 1, 0, 1),
               c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing

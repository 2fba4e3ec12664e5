// The out-of-memory retry policy of a stage job (runtime/out_of_memory.h,
// Note [Out-of-memory retry of a microbatch]), checked without devices:
// which failures are retried, and that a retry starts from the undone state.
#include "runtime/recovery/out_of_memory.h"

#include "roundpipe/execute_plan.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace roundpipe::testing {
namespace {

using detail::OutOfMemoryRetry;
using detail::PlanShrink;

[[noreturn]] void run_out_of_memory() {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (simulated)");
  throw 0;  // (unreachable)
}

// A stage's state as a list of events, so the order of undo and retry shows.
struct Recorder {
  std::vector<std::string> events;
  bool had_gradients = false;
  int undo_points = 0;
  OutOfMemoryRetry::UndoPoint point() {
    ++undo_points;
    return {had_gradients, [this] { events.push_back("undo"); }};
  }
};

TEST(OutOfMemoryRetry, AFailedTryIsUndoneThenRetriedAndTheJobRunsLighterAfter) {
  OutOfMemoryRetry retry(/*caller_plan=*/false);
  Recorder r;
  int notified = 0;
  retry.run([&] { return r.point(); },
            [&] {
              r.events.push_back("try");
              run_out_of_memory();
            },
            [&] { r.events.push_back("retry"); }, [&](const std::string&) { ++notified; });
  EXPECT_EQ(r.events, (std::vector<std::string>{"try", "undo", "retry"}));
  EXPECT_TRUE(retry.lighter());
  EXPECT_EQ(notified, 1);
  // A second retry in the same job does not notify again.
  retry.run([&] { return r.point(); }, [&] { run_out_of_memory(); },
            [&] { r.events.push_back("retry"); }, [&](const std::string&) { ++notified; });
  EXPECT_EQ(notified, 1);
  EXPECT_EQ(r.undo_points, 2);
}

TEST(OutOfMemoryRetry, ASucceedingTryIsNeitherUndoneNorRetried) {
  OutOfMemoryRetry retry(false);
  Recorder r;
  retry.run([&] { return r.point(); }, [&] { r.events.push_back("try"); },
            [&] { r.events.push_back("retry"); }, nullptr);
  EXPECT_EQ(r.events, (std::vector<std::string>{"try"}));
  EXPECT_FALSE(retry.lighter());
}

TEST(OutOfMemoryRetry, ACallersPlanIsNeverRetried) {
  OutOfMemoryRetry retry(/*caller_plan=*/true);
  Recorder r;
  EXPECT_THROW(retry.run([&] { return r.point(); }, [&] { run_out_of_memory(); },
                         [&] { r.events.push_back("retry"); }, nullptr),
               c10::OutOfMemoryError);
  EXPECT_TRUE(r.events.empty());
  EXPECT_FALSE(retry.lighter());
}

TEST(OutOfMemoryRetry, OtherErrorsPropagateUntouched) {
  OutOfMemoryRetry retry(false);
  Recorder r;
  EXPECT_THROW(retry.run([&] { return r.point(); }, [&] { TORCH_CHECK(false, "shape mismatch"); },
                         [&] { r.events.push_back("retry"); }, nullptr),
               c10::Error);
  EXPECT_TRUE(r.events.empty());
}

TEST(OutOfMemoryRetry, ABackwardAddingToEarlierGradientsIsNotRetried) {
  // Its partial sum can't be told apart from the earlier microbatches'.
  OutOfMemoryRetry retry(false);
  Recorder r;
  r.had_gradients = true;
  EXPECT_THROW(retry.run([&] { return r.point(); },
                         [&] {
                           retry.backward_began();
                           run_out_of_memory();
                         },
                         [&] { r.events.push_back("retry"); }, nullptr),
               c10::OutOfMemoryError);
  EXPECT_TRUE(r.events.empty());
  // Without earlier gradients the try's own are dropped by the undo: retried.
  r.had_gradients = false;
  retry.run([&] { return r.point(); },
            [&] {
              retry.backward_began();
              run_out_of_memory();
            },
            [&] { r.events.push_back("retry"); }, nullptr);
  EXPECT_EQ(r.events, (std::vector<std::string>{"undo", "retry"}));
}

TEST(OutOfMemoryRetry, EachTryStartsBeforeItsBackward) {
  // A failure before the backward began is retried even with earlier
  // gradients: the backward_began of an earlier microbatch does not carry over.
  OutOfMemoryRetry retry(false);
  Recorder r;
  retry.run([&] { return r.point(); }, [&] { retry.backward_began(); }, [] {}, nullptr);
  r.had_gradients = true;
  retry.run([&] { return r.point(); }, [&] { run_out_of_memory(); },
            [&] { r.events.push_back("retry"); }, nullptr);
  EXPECT_EQ(r.events, (std::vector<std::string>{"undo", "retry"}));
}

TEST(OutOfMemoryRetry, ARetryThatFailsAgainFailsTheCall) {
  OutOfMemoryRetry retry(false);
  Recorder r;
  EXPECT_THROW(retry.run([&] { return r.point(); }, [&] { run_out_of_memory(); },
                         [&] { run_out_of_memory(); }, nullptr),
               c10::OutOfMemoryError);
  EXPECT_EQ(r.events, (std::vector<std::string>{"undo"}));
}

TEST(PlanShrink, AChosenStageGrainGoesToLayerGrainFirst) {
  const ExecutePlan failed({{0, 2}}, {{2, 4}, {0, 2}});
  const auto next =
      detail::next_shrink({}, failed, RecomputeGrain::kStage, /*grain_chosen=*/true, true);
  EXPECT_EQ(next, (PlanShrink{true, 1.0, 0}));
  // Then, in layer grain, the memory limit: three quarters each time.
  auto again = detail::next_shrink(next, failed, RecomputeGrain::kLayer, true, true);
  again = detail::next_shrink(again, failed, RecomputeGrain::kLayer, true, true);
  EXPECT_TRUE(again.layer_grain_only);
  EXPECT_DOUBLE_EQ(again.limit_scale, 0.75 * 0.75);
  EXPECT_EQ(again.min_stages, 0);
}

TEST(PlanShrink, ACallersGrainIsKeptAndTheLimitShrinks) {
  const ExecutePlan failed({{0, 2}}, {{2, 4}, {0, 2}});
  const auto next =
      detail::next_shrink({}, failed, RecomputeGrain::kStage, /*grain_chosen=*/false, true);
  EXPECT_FALSE(next.layer_grain_only);
  EXPECT_DOUBLE_EQ(next.limit_scale, 0.75);
}

TEST(PlanShrink, WithoutALimitPlansTakeOneStageMoreThanTheFailedOne) {
  const ExecutePlan failed({{0, 2}}, {{2, 4}, {0, 2}});  // 3 stages
  const auto next =
      detail::next_shrink({true, 1.0, 0}, failed, RecomputeGrain::kLayer, true, /*limited=*/false);
  EXPECT_EQ(next.min_stages, 4);
  EXPECT_DOUBLE_EQ(next.limit_scale, 1.0);
}

TEST(OutOfMemoryRetry, TheFirstRetryIsToldTheDevicesMessage) {
  OutOfMemoryRetry retry(false);
  Recorder r;
  std::string told;
  retry.run([&] { return r.point(); }, [&] { run_out_of_memory(); }, [] {},
            [&](const std::string& message) { told = message; });
  EXPECT_NE(told.find("CUDA out of memory (simulated)"), std::string::npos) << told;
}

TEST(DeviceMemoryReport, KeepsWhatTheDeviceHadAndDropsItsAdvice) {
  // c10's CUDA allocator message (torch 2.11), cut after its memory figures.
  const std::string cuda =
      "CUDA out of memory. Tried to allocate 1.25 GiB. GPU 0 has a total capacity of 139.80 GiB "
      "of which 100.1 GiB is free. Process 7 has 39.6 GiB memory in use. Of the allocated memory "
      "21.02 GiB is allocated by PyTorch, and 1.23 GiB is reserved by PyTorch but unallocated. If "
      "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=...\nmore";
  EXPECT_EQ(detail::device_memory_report(cuda),
            "Tried to allocate 1.25 GiB. GPU 0 has a total capacity of 139.80 GiB of which 100.1 "
            "GiB is free. Process 7 has 39.6 GiB memory in use. Of the allocated memory 21.02 GiB "
            "is allocated by PyTorch, and 1.23 GiB is reserved by PyTorch but unallocated.");
  EXPECT_EQ(detail::device_memory_report("Tried to allocate 2 MiB\nsecond line"),
            "Tried to allocate 2 MiB");
  EXPECT_EQ(detail::device_memory_report("simulated device out of memory"), "");
}

}  // namespace
}  // namespace roundpipe::testing

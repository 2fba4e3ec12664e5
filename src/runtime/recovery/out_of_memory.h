// Recovery from a device running out of memory, in one place: a
// microbatch retried by layer inside its stage job (OutOfMemoryRetry), a
// call undone and redone (OutOfMemoryRecovery::undo_for_redo), and the
// smaller plans of later calls (next_shrink, applied by the automatic
// plan). Only a device's c10::OutOfMemoryError recovers so: a host
// allocation that fails is a plain error (HostArena, HostAllocationScope),
// which never changes the device plan. Internal header.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "roundpipe/execute_plan.h"
#include "roundpipe/layer.h"
#include "roundpipe/run_config.h"

namespace roundpipe {
class StageError;
}

namespace roundpipe::detail {

class StatsRecorder;
struct CallState;

// Note [Out-of-memory retry of a microbatch]
// A backward stage or the fused tail in stage grain holds all of its
// layers' activations for a microbatch; where that runs out of memory
// (after the losses have gone back, it would fail the call in the
// background), the microbatch runs again in the same job, by layer
// (by_layer() in microbatch_steps.h): one layer's activations at a time,
// from the stage input it still has, with the random state it started from.
// The failed try is undone first (UndoPoint): its buffer writes are restored
// from a copy taken before it, its parameter gradients dropped, its
// timings forgotten, its save_for_recompute() data dropped; it has sent
// nothing (input gradients go after the microbatch; a loss already sent is
// not sent again, being the same). So the results are those of a try that
// never failed. Not retried: a plan of the caller's (theirs to change), a
// retry that fails again, a failure that is not a device out-of-memory
// error, and a try that failed after its backward began adding to
// gradients that earlier microbatches left (its partial sum can't be told
// apart from theirs without holding a second copy of the stage's
// gradients); those fail the call (Note [Out-of-memory redo], below). The
// fused tail's call has not returned then: each tail job holds its last
// microbatch's loss until that microbatch's backward is done
// (StageBinding::hold_results), so the call is redone, and the device never
// holds that second copy (Note [Tail grain]). The rest of the job runs by
// layer (after_out_of_memory()), and later calls plan smaller.
class OutOfMemoryRetry {
 public:
  // What undoes a try, taken just before it.
  struct UndoPoint {
    bool had_gradients = false;  // earlier microbatches left parameter gradients
    std::function<void()> undo;  // restores the state the point was taken in
  };

  // `caller_plan`: the call runs on a plan of the caller's (never retried).
  explicit OutOfMemoryRetry(bool caller_plan) : caller_plan_(caller_plan) {}

  // The job has retried a microbatch: its later microbatches run by layer.
  bool lighter() const { return lighter_; }

  // From here the try adds to the accumulated parameter gradients.
  void backward_began() { backward_began_ = true; }

  // Runs `first_try`; where it runs out of memory and may be retried,
  // applies `take_undo_point()`'s undo and runs `retry` (whose failure
  // propagates). `on_first_retry` runs once per job, before its first retry,
  // with the device's out-of-memory message.
  void run(const std::function<UndoPoint()>& take_undo_point,
           const std::function<void()>& first_try, const std::function<void()>& retry,
           const std::function<void(const std::string& message)>& on_first_retry);

 private:
  bool caller_plan_;
  bool lighter_ = false;
  bool backward_began_ = false;
};

// Note [Out-of-memory redo]
// A device that runs out of memory during a call fails the call with an
// out-of-memory StageError. Where the engine chose the plan and the call
// has returned nothing yet (forward_backward's losses, forward()'s output),
// it undoes what the failed call did (its gradients are dropped, the
// buffers its forward stages committed are restored from the snapshot
// taken before its first microbatch), makes later plans smaller, and runs
// the call again with the failed call's seed and weight version: the
// random streams, loss, gradients and buffer updates are those of a call
// that never failed, and nothing is applied twice (no optimizer step runs
// in between). After that, a backward stage or the fused tail still running
// retries the microbatch instead (Note [Out-of-memory retry of a
// microbatch], above), and asks for smaller plans here. Smaller means, in
// turn (next_shrink): layer grain where the plan chose stage grain; then a
// memory limit three quarters of the last (or, without a limit, one stage
// more), down to the smallest limit that fits one layer per stage (below it
// there is no plan; a call that still runs out of memory there is redone a
// few times, then fails naming what does not fit). The shrink stays for
// later calls.

// How much smaller the automatic plan's calls are after running out of memory.
struct PlanShrink {
  bool layer_grain_only = false;
  double limit_scale = 1.0;  // of the memory limit
  int min_stages = 0;        // without a limit: at least this many stages
  bool operator==(const PlanShrink&) const = default;
};

// The shrink after a call on `failed` in `grain` (`grain_chosen`: by the
// automatic plan, not the caller) ran out of memory; `limited`: its plans
// have a memory limit. Pure (tests/runtime/recovery/out_of_memory_test.cpp).
PlanShrink next_shrink(const PlanShrink& now, const ExecutePlan& failed, RecomputeGrain grain,
                       bool grain_chosen, bool limited);

// What the device said of its memory in an out-of-memory `message` (CUDA's
// "Tried to allocate X ... Of the allocated memory Y is allocated by
// PyTorch, and Z is reserved by PyTorch but unallocated."), without its
// advice; empty when the message has no such sentence (a simulated
// device's). The warnings carry it, so a plan that under-estimated shows by
// how much and whether it was fragmentation (Z large) or a want (Y large).
std::string device_memory_report(const std::string& message);

// The engine's side of recovery: the redo of a call and the shrink.
class OutOfMemoryRecovery {
 public:
  // `shrink_plans(failed, grain, grain_chosen)`: the automatic plan's
  // (AutoPlan::shrink_after_out_of_memory, which applies next_shrink).
  using ShrinkPlans =
      std::function<void(const ExecutePlan& failed, RecomputeGrain grain, bool grain_chosen)>;
  OutOfMemoryRecovery(const std::string& name, const std::vector<LayerPtr>& layers,
                      ShrinkPlans shrink_plans, StatsRecorder& stats,
                      std::function<void()> drain_host_tasks);

  // Whether `call`, which failed with `error` on its `attempt`-th redo, is
  // redone: a device out-of-memory error on a plan the engine chose, a few
  // times at most (then it throws the error, naming what does not fit).
  // Its effects are undone first, and later plans are smaller.
  bool undo_for_redo(CallState& call, const StageError& error, int attempt);
  // Undoes a failed call's effects before it is redone: waits for its jobs
  // and host tasks, and restores its layers' buffers from the snapshot
  // taken before its first microbatch (its gradients go with the call).
  void undo(CallState& call);

  // Later calls plan smaller after `stage` ran out of memory on `device`
  // (unless the caller gave the plan); warns, saying how it was recovered
  // (`recovery`) and what the device reported (`message`, the error's).
  // Counts in pipeline_stats().out_of_memory_recoveries.
  void shrink(const CallState& call, const std::string& stage, const std::string& device,
              const char* recovery, const std::string& message);

 private:
  const std::string& name_;
  const std::vector<LayerPtr>& layers_;
  ShrinkPlans shrink_plans_;
  StatsRecorder& stats_;
  std::function<void()> drain_host_tasks_;
};

}  // namespace roundpipe::detail

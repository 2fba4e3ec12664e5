// The schedule as data: the stage jobs of a call, in dispatch order, each
// with the device it runs on. A pure function of the plan, the call's
// phase, the device count and the round-robin cursor, so the order of work
// is tested without devices (tests/runtime/planning/schedule_test.cpp); the engine
// dispatches the list it returns and nothing else. Internal header.
#pragma once

#include <string>
#include <vector>

#include "roundpipe/execute_plan.h"

namespace roundpipe::detail {

enum class JobKind {
  kForward,   // a forward stage: runs its layers, saves its input for backward
  kBackward,  // a backward stage: recomputes its layers, then backpropagates
  kTail,      // the fused tail: forward, loss and backward in one job
};
const char* job_kind_name(JobKind kind);

// What part of a call is dispatched at once.
enum class CallPhase {
  kForward,   // forward(): the forward stages (with grad, the backward comes later)
  kBackward,  // the backward stages of a forward() call, from its autograd backward
  kFused,     // forward_backward(): forward stages, the fused tail, backward stages
};

struct ScheduledJob {
  JobKind kind = JobKind::kForward;
  LayerRange range;
  int stage_index = 0;  // its place in the plan's forward or backward list
  // A replicated tail's share: microbatches replica, replica + replicas, ...
  // (every other job runs all microbatches: replica 0 of 1).
  int replica = 0;
  int replicas = 1;
  int device = 0;  // index in the device pool
  bool operator==(const ScheduledJob& other) const = default;
  // "fused tail stage 0 (layers 3..4) replica 1 of 2", as errors name it.
  std::string describe() const;
};

// The jobs of one phase of a call over `num_devices` devices whose
// round-robin turn is `first_device`: the jobs take consecutive turns in
// dispatch order. Fused calls: forward stages (shallow first), then the
// tail (once per replica, min(plan.tail_replicas, microbatches) of them,
// on consecutive devices), then the backward stages (deep first). The
// caller advances its cursor by the number of jobs.
std::vector<ScheduledJob> schedule_call(const ExecutePlan& plan, CallPhase phase, int num_devices,
                                        int first_device, int microbatches);

// The same jobs grouped by device, each device's in the order it runs them
// (its worker takes jobs first come, first served).
std::vector<std::vector<ScheduledJob>> jobs_per_device(const std::vector<ScheduledJob>& jobs,
                                                       int num_devices);

}  // namespace roundpipe::detail

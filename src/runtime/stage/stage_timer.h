// The compute intervals of one stage job's microbatch, timed with device
// marks and handed to LayerTimings on the host-task thread once the last
// one has completed (they feed the automatic plan). Internal header.
#pragma once

#include <map>
#include <utility>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/execute_plan.h"
#include "runtime/parts/host_tasks.h"
#include "runtime/planning/layer_timings.h"

namespace roundpipe::detail {

// One measured interval; layer -1: a backward through several layers at
// once (BackwardKind::kShared or kApart), shared by them.
struct TimedInterval {
  int layer = -1;
  LayerTimings::Kind kind = LayerTimings::kForward;
  double seconds = 0;
};

// One sample per layer and kind from a microbatch's intervals: a microbatch
// run in chunks of rows (Note [Tail row chunks]) adds its chunks' times up;
// a shared backward goes to the layers of `shared_by` in proportion to
// their forward-side (recompute or forward) times, evenly where they have
// none. Pure: tested without devices (tests/runtime/stage/stage_timer_test.cpp).
std::map<std::pair<int, LayerTimings::Kind>, double> per_layer_times(
    const std::vector<TimedInterval>& measured, LayerRange shared_by);

class StageTimer {
 public:
  StageTimer(Device& device, LayerTimings& timings, HostTasks& host_tasks)
      : device_(device), timings_(timings), host_tasks_(host_tasks) {}

  EventPtr mark() { return device_.record_timing_mark(); }
  void add(int layer, LayerTimings::Kind kind, EventPtr start, EventPtr end) {
    intervals_.push_back({layer, kind, std::move(start), std::move(end)});
  }
  // A shared backward from layer `first` on (to the end of the stage).
  void add_shared_backward(int first, EventPtr start, EventPtr end) {
    shared_from_ = first;
    add(-1, LayerTimings::kBackward, std::move(start), std::move(end));
  }
  // For a try that is undone (Note [Out-of-memory retry of a microbatch]).
  size_t count() const { return intervals_.size(); }
  void forget_after(size_t count) { intervals_.resize(count); }
  // Hands this microbatch's intervals to the host-task thread (`stage`:
  // the job's layers).
  void flush(LayerRange stage);

 private:
  struct Interval {
    int layer;
    LayerTimings::Kind kind;
    EventPtr start, end;
  };
  Device& device_;
  LayerTimings& timings_;
  HostTasks& host_tasks_;
  std::vector<Interval> intervals_;
  int shared_from_ = 0;
};

}  // namespace roundpipe::detail

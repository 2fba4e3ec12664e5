// A stage job's compute intervals: see stage_timer.h.
#include "runtime/stage/stage_timer.h"

#include <algorithm>

namespace roundpipe::detail {

std::map<std::pair<int, LayerTimings::Kind>, double> per_layer_times(
    const std::vector<TimedInterval>& measured, LayerRange shared_by) {
  std::map<std::pair<int, LayerTimings::Kind>, double> per_layer;
  std::map<int, double> forward_side;
  double shared = -1;
  for (const auto& i : measured) {
    if (i.layer < 0) {
      shared = std::max(shared, 0.0) + i.seconds;
      continue;
    }
    per_layer[{i.layer, i.kind}] += i.seconds;
    if (i.kind != LayerTimings::kBackward) forward_side[i.layer] += i.seconds;
  }
  if (shared < 0 || shared_by.size() <= 0) return per_layer;
  double total = 0;
  for (int l = shared_by.begin; l < shared_by.end; ++l) total += forward_side[l];
  for (int l = shared_by.begin; l < shared_by.end; ++l) {
    const double share = total > 0 ? forward_side[l] / total : 1.0 / shared_by.size();
    per_layer[{l, LayerTimings::kBackward}] += shared * share;
  }
  return per_layer;
}

void StageTimer::flush(LayerRange stage) {
  if (intervals_.empty()) return;
  auto measured = std::move(intervals_);
  intervals_.clear();
  const LayerRange shared_by{std::max(shared_from_, stage.begin), stage.end};
  auto* timings = &timings_;
  Device* device = &device_;
  host_tasks_.post(measured.back().end, [measured, timings, device, shared_by] {
    std::vector<TimedInterval> seconds;
    for (const auto& i : measured)
      seconds.push_back({i.layer, i.kind, device->seconds_between(i.start, i.end)});
    for (const auto& [key, s] : per_layer_times(seconds, shared_by))
      timings->add(key.first, key.second, s);
  });
}

}  // namespace roundpipe::detail

#include "runtime/planning/schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace roundpipe::detail {

const char* job_kind_name(JobKind kind) {
  switch (kind) {
    case JobKind::kForward:
      return "forward";
    case JobKind::kBackward:
      return "backward";
    case JobKind::kTail:
      return "fused tail";
  }
  return "?";
}

std::string ScheduledJob::describe() const {
  std::string text = std::string(job_kind_name(kind)) + " stage " + std::to_string(stage_index) +
                     " (layers " + std::to_string(range.begin) + ".." +
                     std::to_string(range.end - 1) + ")";
  if (replicas > 1) {
    text += " replica " + std::to_string(replica) + " of " + std::to_string(replicas);
  }
  return text;
}

std::vector<ScheduledJob> schedule_call(const ExecutePlan& plan, CallPhase phase, int num_devices,
                                        int first_device, int microbatches) {
  TORCH_CHECK(num_devices > 0 && first_device >= 0 && first_device < num_devices,
              "schedule_call: bad device turn ", first_device, " of ", num_devices);
  TORCH_CHECK(microbatches > 0, "schedule_call: needs at least one microbatch");
  std::vector<ScheduledJob> jobs;
  auto add = [&](JobKind kind, const LayerRange& range, int stage, int replica, int replicas) {
    ScheduledJob job;
    job.kind = kind;
    job.range = range;
    job.stage_index = stage;
    job.replica = replica;
    job.replicas = replicas;
    job.device = (first_device + static_cast<int>(jobs.size())) % num_devices;
    jobs.push_back(job);
  };
  auto add_stages = [&](JobKind kind, const std::vector<LayerRange>& ranges, size_t from) {
    for (size_t i = from; i < ranges.size(); ++i) add(kind, ranges[i], static_cast<int>(i), 0, 1);
  };
  switch (phase) {
    case CallPhase::kForward:
      add_stages(JobKind::kForward, plan.forward, 0);
      break;
    case CallPhase::kBackward:
      add_stages(JobKind::kBackward, plan.backward, 0);
      break;
    case CallPhase::kFused: {
      TORCH_CHECK(!plan.backward.empty(), "schedule_call: a fused plan needs a tail stage");
      add_stages(JobKind::kForward, plan.forward, 0);
      const int replicas = std::max(1, std::min(plan.tail_replicas, microbatches));
      for (int r = 0; r < replicas; ++r) add(JobKind::kTail, plan.backward[0], 0, r, replicas);
      add_stages(JobKind::kBackward, plan.backward, 1);
      break;
    }
  }
  return jobs;
}

std::vector<std::vector<ScheduledJob>> jobs_per_device(const std::vector<ScheduledJob>& jobs,
                                                       int num_devices) {
  std::vector<std::vector<ScheduledJob>> out(num_devices);
  for (const auto& job : jobs) out.at(job.device).push_back(job);
  return out;
}

}  // namespace roundpipe::detail

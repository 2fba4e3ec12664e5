// Recovery from a device running out of memory: see out_of_memory.h.
#include "runtime/recovery/out_of_memory.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "roundpipe/errors.h"
#include "runtime/parts/call.h"
#include "runtime/parts/stats_recorder.h"

namespace roundpipe::detail {

void OutOfMemoryRetry::run(const std::function<UndoPoint()>& take_undo_point,
                           const std::function<void()>& first_try,
                           const std::function<void()>& retry,
                           const std::function<void(const std::string&)>& on_first_retry) {
  UndoPoint point = take_undo_point();
  backward_began_ = false;
  std::string message;
  try {
    first_try();
    return;
  } catch (const c10::OutOfMemoryError& e) {
    if (caller_plan_ || (backward_began_ && point.had_gradients)) throw;
    message = e.what_without_backtrace();
  }
  if (point.undo) point.undo();
  if (!lighter_) {
    lighter_ = true;
    if (on_first_retry) on_first_retry(message);
  }
  backward_began_ = false;
  retry();
}

PlanShrink next_shrink(const PlanShrink& now, const ExecutePlan& failed, RecomputeGrain grain,
                       bool grain_chosen, bool limited) {
  PlanShrink next = now;
  if (grain_chosen && grain == RecomputeGrain::kStage && !now.layer_grain_only) {
    next.layer_grain_only = true;
  } else if (limited) {
    next.limit_scale *= 0.75;
  } else {
    next.min_stages = static_cast<int>(failed.forward.size() + failed.backward.size()) + 1;
  }
  return next;
}

std::string device_memory_report(const std::string& message) {
  const auto begin = message.find("Tried to allocate");
  if (begin == std::string::npos) return "";
  auto end = message.find(" If reserved but unallocated", begin);
  end = std::min(end, message.find('\n', begin));
  return message.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

OutOfMemoryRecovery::OutOfMemoryRecovery(const std::string& name,
                                         const std::vector<LayerPtr>& layers,
                                         ShrinkPlans shrink_plans, StatsRecorder& stats,
                                         std::function<void()> drain_host_tasks)
    : name_(name),
      layers_(layers),
      shrink_plans_(std::move(shrink_plans)),
      stats_(stats),
      drain_host_tasks_(std::move(drain_host_tasks)) {}

bool OutOfMemoryRecovery::undo_for_redo(CallState& call, const StageError& error, int attempt) {
  // (A plan of the caller's is theirs to change; a few redos bound the
  // loop where something else than the plan runs out of memory.)
  constexpr int kMaxRedos = 6;
  if (!error.out_of_memory || call.config.execute_plan.has_value()) return false;
  if (attempt >= kMaxRedos) {
    std::ostringstream what;
    what << error.what() << "\n"
         << name_ << ": the call ran out of memory on " << kMaxRedos + 1
         << " plans in a row, each smaller (the last: " << call.plan.to_string() << ", "
         << to_string(call.grain)
         << " grain): what one microbatch needs beyond the plan's estimate does not fit. Give "
            "the device more memory, or split the batch into more microbatches (num_microbatch), "
            "or pass shorter sequences.";
    throw StageError(what.str(), error.stage, error.layer, error.microbatch, error.phase,
                     error.device, true, error.cause);
  }
  undo(call);
  shrink(call, error.stage, error.device, "the call is redone", error.what());
  return true;
}

void OutOfMemoryRecovery::undo(CallState& call) {
  // Its jobs have stopped (the engine's collect waited); its gradients and
  // buffer commits still in the host tasks land, then its forward stages'
  // buffer writes are undone from the snapshot taken before its first
  // microbatch.
  call.work.wait_none();
  drain_host_tasks_();
  call.restore_buffer_snapshots([this](int layer) { return layers_[layer]->buffers(); });
}

void OutOfMemoryRecovery::shrink(const CallState& call, const std::string& stage,
                                 const std::string& device, const char* recovery,
                                 const std::string& message) {
  stats_.count(&PipelineStats::out_of_memory_recoveries);
  if (call.config.execute_plan) return;  // the caller's plan is theirs to change
  shrink_plans_(call.plan, call.grain, call.grain_chosen);
  const std::string report = device_memory_report(message);
  TORCH_WARN(name_, ": ", stage, " ran out of memory on ", device, "; ", recovery,
             ", and later calls run on a smaller plan (layer grain, or a lower memory limit)",
             report.empty() ? "" : " (the device: ", report, report.empty() ? "" : ")");
}

}  // namespace roundpipe::detail

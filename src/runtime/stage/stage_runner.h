// One stage job on one device: a forward stage, a backward stage (with its
// recompute, in stage or layer grain) or the fused tail (forward, loss and
// backward), its parameter gradients and buffer commits. It works against
// the parts below the engine, never the engine. Internal header.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "roundpipe/layer.h"
#include "runtime/parts/call.h"
#include "runtime/parts/commit_ledger.h"
#include "runtime/parts/gradient_ledger.h"
#include "runtime/parts/host_tasks.h"
#include "runtime/parts/layer_instances.h"
#include "runtime/parts/stats_recorder.h"
#include "runtime/parts/weight_table.h"
#include "runtime/planning/layer_timings.h"
#include "runtime/stage/device_worker.h"

namespace roundpipe::detail {

// Whether a caller's loss function may run on chunks of rows (Note [A
// caller's loss over row chunks]): unknown until a tail has run it on a
// whole microbatch; then checked chunks, or whole microbatches for good.
enum CallersLoss : int { kCallersLossUnknown = 0, kCallersLossChunks, kCallersLossWhole };

// What a stage job uses; owned by the engine, outlives every job.
struct StageContext {
  const std::string& name;  // the engine's, for messages
  const std::vector<LayerPtr>& layers;
  WeightTable& weights;
  LayerInstances& instances;
  LayerTimings& timings;  // measured per-layer times and activation bytes
  HostTasks& host_tasks;  // buffer commits and timings after device events
  HostTasks& grad_tasks;  // parameter-gradient sums
  GradientLedger& grads;
  CommitLedger& commits;
  StatsRecorder& stats;
  // A microbatch that ran out of memory was retried by layer (Note
  // [Out-of-memory retry of a microbatch]): later calls plan smaller.
  // `message`: the device's out-of-memory error.
  std::function<void(const CallState& call, const std::string& stage, const std::string& device,
                     const std::string& message)>
      out_of_memory_retried;
  // What the fused tail learned of a caller's loss function (Note [A
  // caller's loss over row chunks]): a CallersLoss.
  std::atomic<int>& callers_loss;
};

// Runs `job` on `worker`'s device. An error fails the job's call with its
// context (stage, layer, microbatch, phase, device); it never escapes.
void run_stage_job(const StageContext& context, Job& job, DeviceWorker& worker);

}  // namespace roundpipe::detail

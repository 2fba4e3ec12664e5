// The engine behind roundpipe::RoundPipe: builds and wires the runtime's
// parts (docs/architecture.md has the picture) and runs the public calls:
// a call is set up (call.h), its schedule (schedule.h) dispatched to the
// device workers (device_worker.h), which run each stage job
// (stage_runner.h) against the weight table, the ledgers and the host
// tasks; the optimizer stream steps after the calls. Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/execute_plan.h"
#include "roundpipe/layer.h"
#include "roundpipe/optim/adam.h"
#include "roundpipe/optim/grad_scaler.h"
#include "roundpipe/options.h"
#include "roundpipe/planner.h"
#include "roundpipe/run_config.h"
#include "runtime/engine/auto_plan.h"
#include "runtime/engine/optimizer_stream.h"
#include "runtime/parts/call.h"
#include "runtime/parts/commit_ledger.h"
#include "runtime/parts/gradient_ledger.h"
#include "runtime/parts/host_tasks.h"
#include "runtime/parts/layer_instances.h"
#include "runtime/parts/stats_recorder.h"
#include "runtime/parts/weight_table.h"
#include "runtime/planning/layer_timings.h"
#include "runtime/planning/schedule.h"
#include "runtime/recovery/out_of_memory.h"
#include "runtime/stage/device_worker.h"
#include "runtime/stage/stage_runner.h"

namespace roundpipe::detail {

class Engine {
 public:
  Engine(std::vector<LayerPtr> layers, RoundPipeOptions options);
  ~Engine();

  c10::IValue forward(const c10::IValue& input, const RunConfig& config);
  ForwardBackwardResult forward_backward(const c10::IValue& input, const c10::IValue& label,
                                         const LossFn& loss_fn, bool return_outputs,
                                         const RunConfig& config);
  void synchronize();
  bool wait_for_background_work();
  void restore_pending_update();
  void step(std::function<void()> step_fn, bool is_async);
  void step_fused(optim::Adam& adam, bool is_async, optim::GradScaler* scaler,
                  optim::GradClipper* clip);
  void step_fused(optim::FusedUpdate update, bool is_async);
  std::vector<at::Tensor> optim_parameters();
  std::vector<std::pair<std::string, at::Tensor>> optim_named_parameters();

  std::vector<at::Tensor> parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_buffers() const;
  int num_layers() const { return static_cast<int>(layers_.size()); }
  const DevicePool& pool() const { return pool_; }
  const std::string& name() const { return name_; }
  // The automatic plan for calls with the model's run config.
  ExecutePlan default_plan(bool fused);
  // The automatic plan with its predicted stage times and memory, under
  // model_memory_limit (default: what the smallest device had left when the
  // engine was made), for calls in `grain` (default: the model's, else the
  // automatic choice of its calls).
  PlanEstimate auto_plan(bool fused, int num_microbatches, int min_stages,
                         std::optional<double> memory_limit_gib,
                         std::optional<RecomputeGrain> grain = std::nullopt,
                         int tail_rows = 0) const;
  std::optional<c10::ScalarType> optim_dtype() const { return options_.optim_dtype; }
  const DataParallelOptions* data_parallel() const { return options_.data_parallel.get(); }
  HostMemoryStats host_memory_stats() const { return weights_.host_memory_stats(); }
  PipelineStats pipeline_stats() const { return stats_.snapshot(); }
  double measure_weight_upload_rate();

 private:
  RunConfig resolve(const RunConfig& config) const;
  // Refuses a blocking call (`what`) made from one of this engine's own
  // threads, which it would wait for forever (Note [Calls from engine threads]).
  void check_caller_thread(const char* what) const;
  enum class CallKind { kForward, kTrainingForward, kForwardBackward };
  // `redo_of`: a call that ran out of memory, whose seed and weight
  // version this one takes (Note [Out-of-memory redo]).
  std::shared_ptr<CallState> start_call(const c10::IValue& input, const RunConfig& config,
                                        CallKind kind, const CallState* redo_of = nullptr);
  // Starts a call of `kind` (`prepare` completing its set-up), dispatches
  // it and collects the slots `results` picks (its losses, or its outputs);
  // redone on a smaller plan when it runs out of memory first (Note
  // [Out-of-memory redo]). `call` is the call that succeeded.
  std::vector<c10::IValue> run_call(
      const c10::IValue& input, const RunConfig& config, CallKind kind,
      std::shared_ptr<CallState>& call, const std::function<void(CallState&)>& prepare,
      const std::function<std::vector<std::shared_ptr<Slot>>&(CallState&)>& results);
  // forward_backward: the gradients of its inputs that require grad, sent
  // upstream through autograd once its backward is done.
  void send_input_grads_upstream(const std::shared_ptr<CallState>& call, const c10::IValue& input);
  // Dispatches the call's jobs of `phase` (schedule.h) to the devices whose
  // round-robin turns they take.
  void dispatch(const std::shared_ptr<CallState>& call, CallPhase phase);
  void dispatch(const std::shared_ptr<CallState>& call, const ScheduledJob& job);
  // After a job ran and its upload is done: releases what it held.
  void job_finished(Job& job);
  // Runs a training forward's backward stages (from autograd) and waits.
  void run_backward_pass(const std::shared_ptr<CallState>& call);
  // The values of `slots` once their copies have landed; a failed call's
  // error once its jobs have stopped.
  std::vector<c10::IValue> collect(const std::shared_ptr<CallState>& call,
                                   std::vector<std::shared_ptr<Slot>>& slots);
  // What a new call checks first: errors earlier calls left behind
  // (each reported once). It waits for nothing: earlier calls'
  // stages run on ahead of it in the workers' queues (weight versions
  // order the uploads, per-layer commits the buffers).
  void check_earlier_calls();
  // Rethrows (once) the error of an unconsumed call that failed.
  void report_failed_call();
  // Drains the host-task queues (all of them, even after an error), then
  // rethrows the first error.
  void drain_host_tasks();
  // Waits for every job, host task and optimizer step; rethrows the first
  // error. Publishes nothing and leaves unconsumed calls where they are.
  void settle();
  // The training calls whose gradients no step() or synchronize() took yet.
  std::vector<std::shared_ptr<CallState>> take_unconsumed_calls();

  // Members in construction order; each part refers only to those above it.
  std::string name_;
  RoundPipeOptions options_;
  std::vector<LayerPtr> layers_;
  DevicePool pool_;
  WeightTable weights_;
  LayerTimings timings_;
  LayerInstances instances_;
  StatsRecorder stats_;
  CommitLedger commits_;  // the order of buffer commits across overlapping calls
  GradientLedger grads_;  // the calls' parameter gradients as backward stages deliver them
  AutoPlan auto_plan_;
  // Host work after device events: the light, latency-bound kind (buffer
  // commits a next call waits for, upload reads the optimizer's publish
  // waits for, timings), and the gradients' accumulation apart, so that
  // the former never queue behind the latter's large adds.
  HostTasks host_tasks_{this};
  HostTasks grad_tasks_{this};
  // A call redone, a microbatch retried, later plans smaller (Note
  // [Out-of-memory redo]).
  OutOfMemoryRecovery recovery_;
  std::atomic<int> callers_loss_{kCallersLossUnknown};  // Note [A caller's loss over row chunks]
  StageContext stage_context_;
  WorkCounter in_flight_;  // stage jobs dispatched, not finished
  WorkerContext worker_context_;
  std::vector<std::unique_ptr<DeviceWorker>> workers_;
  int64_t calls_started_ = 0;
  std::vector<std::shared_ptr<CallState>> unconsumed_calls_;
  // Last: destroyed (its thread joined) before the members its steps use.
  OptimizerStream optimizer_;
};

}  // namespace roundpipe::detail

// The engine behind roundpipe::RoundPipe: parameter table, per-device
// workers, job dispatch, and the three stage jobs (forward, backward with
// recompute, fused tail). Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/execute_plan.h"
#include "roundpipe/layer.h"
#include "roundpipe/optim/adam.h"
#include "roundpipe/optim/grad_scaler.h"
#include "roundpipe/options.h"
#include "roundpipe/planner.h"
#include "roundpipe/run_config.h"
#include "runtime/call.h"
#include "runtime/commit_ledger.h"
#include "runtime/gradient_ledger.h"
#include "runtime/host_arena.h"
#include "runtime/host_tasks.h"
#include "runtime/layer_timings.h"
#include "runtime/schedule.h"

namespace roundpipe::detail {

class Worker;

// A unique parameter (tied weights appear once).
struct ParamEntry {
  at::Tensor home;    // CPU tensor, the model's own parameter (what uploads read)
  std::string name;   // "<layer>.<name in the layer>" of its first use
  at::Tensor master;  // optim_dtype copy the optimizer updates (trainable only)
  // Weight versions: `published` is the number of optimizer updates the home
  // tensor reflects; `reads[v]` counts dispatched jobs that will read version v
  // and have not finished their upload. Publishing v+1 waits for reads <= v.
  int64_t published = 0;
  std::map<int64_t, int> reads;
  // Fused async steps write the next low-precision weight here; publishing
  // swaps it in as the home storage (the old storage becomes the next staging).
  at::Tensor staging;
  bool staged = false;
  // The version `staging` holds once the update has written it (-1: none):
  // a call that reads it uploads from there, without waiting for publish,
  // which must wait until the previous version's readers are done.
  int64_t staged_version = -1;
};

// The value with its tensors moved to `device` (tensors already there kept).
c10::IValue to_device(const c10::IValue& value, c10::Device device);

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
  void step_fused(optim::Adam& adam, bool is_async, optim::GradScaler* scaler);
  std::vector<at::Tensor> optim_parameters();
  std::vector<std::pair<std::string, at::Tensor>> optim_named_parameters();

  std::vector<at::Tensor> parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_buffers() const;
  int num_layers() const { return static_cast<int>(layers_.size()); }
  const DevicePool& pool() const { return pool_; }
  const std::string& name() const { return name_; }
  ExecutePlan default_plan(bool fused) const;
  // The automatic plan for a call of `n` microbatches in `grain` (verbose:
  // logged).
  ExecutePlan default_plan(bool fused, int n, RecomputeGrain grain) const;
  // The automatic plan with its predicted stage times and memory, under
  // model_memory_limit (default: what the smallest device had left when the
  // engine was made), for calls in `grain` (default: the model's).
  PlanEstimate auto_plan(bool fused, int num_microbatches, int min_stages,
                         std::optional<double> memory_limit_gib,
                         std::optional<RecomputeGrain> grain = std::nullopt) const;
  RecomputeGrain default_grain() const {
    return options_.model_run_config.recompute_grain.value_or(RecomputeGrain::kStage);
  }
  std::optional<c10::ScalarType> optim_dtype() const { return options_.optim_dtype; }
  HostMemoryStats host_memory_stats() const { return {host_arena_->stats(), model_state_bytes_}; }
  PipelineStats pipeline_stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }

  // Used by workers and the autograd function.
  void run_job(Job& job, Worker& worker);
  void job_finished(Job& job);
  // Weight-version fences for the parameters a job uploads.
  // (A parameter's weights of a version are available once published, or
  // once staged by a fused async step.)
  static bool weights_available(const ParamEntry& entry, int64_t version);
  // Waits until the job's weights version is available; false when its
  // call failed first.
  bool wait_params_published(const Job& job);
  // The host tensors that hold the job's weights version (home or staging).
  std::vector<at::Tensor> weights_to_upload(const Job& job);
  void release_reads(Job& job);
  // Waits until earlier calls have committed the buffers the job reads.
  void wait_for_earlier_commits(const Job& job);
  void run_backward_pass(const std::shared_ptr<CallState>& call);
  std::unique_ptr<LayerInstance> acquire_instance(int layer, Device& device);
  void release_instance(int layer, std::unique_ptr<LayerInstance> instance);

 private:
  friend struct StageRunner;
  friend class Worker;
  RunConfig resolve(const RunConfig& config) const;
  // Refuses a blocking call (`what`) made from one of this engine's own
  // threads, which it would wait for forever (Note [Calls from engine threads]).
  void check_caller_thread(const char* what) const;
  std::shared_ptr<CallState> start_call(const c10::IValue& input, const RunConfig& config,
                                        bool fused, bool training);
  // The call's jobs of `phase` (schedule.h) on the devices whose turns they
  // take, and the dispatch of one of them to its device's worker.
  std::vector<ScheduledJob> schedule(const CallState& call, CallPhase phase);
  void dispatch(const std::shared_ptr<CallState>& call, const ScheduledJob& job);
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
  // Waits until no stage job is queued or running on any device.
  void wait_for_jobs();
  // Waits for `calls` to finish and sums their parameter gradients; throws
  // the first call's error (a failed call contributes nothing).
  std::map<int, at::Tensor> take_call_grads(std::vector<std::shared_ptr<CallState>> calls);
  void ensure_masters();
  // Copies the masters into the home tensors as version v, parameter by
  // parameter in forward order, each once no job still reads an older one.
  void publish(int64_t version);
  void publish_version_only(int64_t version);
  // Queues one optimizer step; `update_masters` runs on the optimizer thread
  // with the summed gradients of the calls since the last step.
  void queue_step(std::function<void(std::map<int, at::Tensor>&)> update_masters, bool is_async,
                  bool fused, bool piecewise);
  // Per-parameter publishing (publish() does every parameter).
  void publish_one(ParamEntry& entry, int64_t version);
  // Sets the version and forgets finished reads (versions_mu_ held).
  void mark_published(ParamEntry& entry, int64_t version);
  // Runs `update` on batches of the calls' summed gradients, each as soon as
  // every backward stage producing them has delivered (deepest layers
  // first, while shallower stages still run), publishing `pending_version`
  // (if >= 0) for each parameter just before; then waits for the calls and
  // rethrows the first one's error.
  void update_as_gradients_arrive(std::vector<std::shared_ptr<CallState>> calls,
                                  int64_t pending_version,
                                  const std::function<void(std::map<int, at::Tensor>&)>& update);

  std::vector<c10::IValue> collect(const std::shared_ptr<CallState>& call,
                                   std::vector<std::shared_ptr<Slot>>& slots);

  std::string name_;
  RoundPipeOptions options_;
  std::vector<LayerPtr> layers_;
  std::vector<ParamEntry> params_;
  std::vector<std::vector<int>> layer_param_ids_;  // per layer: unique id of each parameter
  std::vector<int64_t> layer_bytes_;
  std::vector<int64_t> layer_grad_bytes_;  // bytes of the parameters that require grad
  std::unique_ptr<LayerTimings> timings_;  // measured per-layer compute times
  // Host-to-device bytes per second, probed once on the first device when
  // the engine is made (before any work competes for the host or the link).
  double upload_bytes_per_second() const;
  mutable std::once_flag upload_probe_once_;
  // The memory limit of plans without model_memory_limit: 90% of what the
  // smallest device had left when the engine was made (0: unlimited).
  int64_t default_memory_limit_bytes_ = 0;
  bool all_layers_meterable_ = true;  // else the planner keeps half the limit for activations
  mutable double upload_bytes_per_second_ = 0;
  mutable std::mutex plan_log_mu_;
  mutable std::string logged_plans_[2];  // verbose: the last plan logged (forward, fused)
  // The automatic plan in use per (fused, microbatches): kept while a new
  // one would not be clearly faster (PlanRequest::incumbent).
  using PlanKey = std::tuple<bool, int, RecomputeGrain>;  // fused, microbatches, grain
  mutable std::map<PlanKey, ExecutePlan> plans_in_use_;
  // Buffers: whether any layer has some, whether a call has committed them,
  // whether a commit changed one (host-task thread). Replicated tail stages
  // need buffers that no forward writes.
  bool has_buffers_ = false;
  std::atomic<bool> buffers_committed_{false};
  std::atomic<bool> buffers_written_{false};
  std::vector<void*> registered_;  // host memory pinned in place (pin_model=register)
  DevicePool pool_;
  // pin_model=alloc: the parameters' homes, staging copies and downloads
  // (pinned where the devices support it); downloads come from
  // `host_allocator_`, empty in the other modes (the backend's own memory).
  std::unique_ptr<HostArena> host_arena_;
  HostAllocator host_allocator_;
  int64_t model_state_bytes_ = 0;
  std::vector<std::unique_ptr<Worker>> workers_;
  // Host work after device events: the light, latency-bound kind (buffer
  // commits a next call waits for, upload reads the optimizer's publish
  // waits for, timings), and the gradients' accumulation apart, so that
  // the former never queue behind the latter's large adds.
  HostTasks host_tasks_{this};
  HostTasks grad_tasks_{this};

  std::mutex instances_mu_;
  std::vector<std::vector<std::unique_ptr<LayerInstance>>> free_instances_;

  std::mutex inflight_mu_;
  std::condition_variable inflight_cv_;
  int inflight_ = 0;
  // Training calls whose gradients no step() or synchronize() took yet.
  std::vector<std::shared_ptr<CallState>> unconsumed_calls_;
  // The order of buffer commits across overlapping calls.
  CommitLedger commits_;

  std::mutex versions_mu_;
  std::condition_variable versions_cv_;
  // The calls' parameter gradients as their backward stages deliver them.
  GradientLedger grads_;
  int64_t updates_ = 0;  // step() calls so far
  int64_t calls_started_ = 0;
  int64_t version_for_new_calls_ = 0;  // weights a new call reads
  int64_t pending_publish_ = -1;       // async: masters hold this version, homes not yet

  mutable std::mutex stats_mu_;
  PipelineStats stats_;
  // Adds the seconds since `start` to one of stats_'s fields.
  void add_seconds(double PipelineStats::*field, std::chrono::steady_clock::time_point start);

  // Last: destroyed (its thread joined) before the members its tasks use.
  HostTasks optimizer_{this};  // the optimizer thread
};

}  // namespace roundpipe::detail

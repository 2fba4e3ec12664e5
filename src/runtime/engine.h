// The engine behind roundpipe::RoundPipe: parameter table, per-device
// workers, job dispatch, and the three stage jobs (forward, backward with
// recompute, fused tail). Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "roundpipe/roundpipe.h"

namespace roundpipe::detail {

struct CallState;
struct Job;
class Worker;

// Generator state at a point of a microbatch's random stream (rng.h).
struct RngState {
  bool active = false;  // false: preserve_rng_state is off, leave generators alone
  at::Tensor state;     // generator state; undefined: start from `seed`
  uint64_t seed = 0;
};

// A value handed from one job to another through host memory: a host-side
// signal plus the device event that completes when the copy has landed.
struct Slot {
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;
  c10::IValue value;                // activations: CPU IValue
  std::vector<at::Tensor> tensors;  // gradients: flat, undefined = no gradient
  EventPtr event;
  RngState rng;
};

// A unique parameter (tied weights appear once).
struct ParamEntry {
  at::Tensor home;        // CPU tensor, the model's own parameter
  at::Tensor grad_accum;  // summed gradients since the last synchronize()
};

// Runs host work in order once the event it waits for has completed
// (gradient accumulation, buffer commits).
class HostTasks {
 public:
  HostTasks();
  ~HostTasks();
  void post(EventPtr event, std::function<void()> task);
  // Waits until every posted task ran; rethrows the first failure.
  void drain();

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<EventPtr, std::function<void()>>> tasks_;
  int running_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

class Engine {
 public:
  Engine(std::vector<LayerPtr> layers, RoundPipeOptions options);
  ~Engine();

  c10::IValue forward(const c10::IValue& input, const RunConfig& config);
  ForwardBackwardResult forward_backward(const c10::IValue& input, const c10::IValue& label,
                                         const LossFn& loss_fn, bool return_outputs,
                                         const RunConfig& config);
  void synchronize();

  std::vector<at::Tensor> parameters() const;
  int num_layers() const { return static_cast<int>(layers_.size()); }
  const DevicePool& pool() const { return pool_; }
  const std::string& name() const { return name_; }
  ExecutePlan default_plan(bool fused) const;
  std::optional<c10::ScalarType> optim_dtype() const { return options_.optim_dtype; }

  // Used by workers and the autograd function.
  void run_job(Job& job, Worker& worker);
  void job_finished();
  void run_backward_pass(const std::shared_ptr<CallState>& call);
  std::unique_ptr<LayerInstance> acquire_instance(int layer, Device& device);
  void release_instance(int layer, std::unique_ptr<LayerInstance> instance);

 private:
  friend struct StageRunner;
  friend class Worker;
  RunConfig resolve(const RunConfig& config) const;
  std::shared_ptr<CallState> start_call(const c10::IValue& input, const RunConfig& config,
                                        bool fused, bool training);
  void dispatch(const std::shared_ptr<CallState>& call, int kind, const LayerRange& range,
                int stage_index);
  // Waits for every job and host task of earlier calls; rethrows an error a
  // background backward pass left behind.
  void fence();
  // Adds a finished call's parameter gradients to the accumulators.
  void finish_call(CallState& call);
  std::vector<c10::IValue> collect(const std::shared_ptr<CallState>& call,
                                   std::vector<std::shared_ptr<Slot>>& slots);

  std::string name_;
  RoundPipeOptions options_;
  std::vector<LayerPtr> layers_;
  std::vector<ParamEntry> params_;
  std::vector<std::vector<int>> layer_param_ids_;  // per layer: unique id of each parameter
  std::vector<int64_t> layer_bytes_;
  std::vector<void*> registered_;  // host memory pinned in place (pin_model=register)
  DevicePool pool_;
  std::vector<std::unique_ptr<Worker>> workers_;
  HostTasks host_tasks_;

  std::mutex instances_mu_;
  std::vector<std::vector<std::unique_ptr<LayerInstance>>> free_instances_;

  std::mutex inflight_mu_;
  std::condition_variable inflight_cv_;
  int inflight_ = 0;
  std::vector<std::shared_ptr<CallState>> background_calls_;
};

}  // namespace roundpipe::detail

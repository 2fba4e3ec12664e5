// One stage job's surroundings, wired as the engine wires them
// (runtime/engine/engine.cpp: the weight table, instances, timings,
// ledgers, host tasks and a device worker) around one simulated device, so
// that a test sets up a call by hand, runs single forward, backward or tail
// jobs of it, and reads what each left: the hand-off slots, the call's
// parameter gradients, the layers' home buffers and the call's error.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "runtime/parts/call.h"
#include "runtime/parts/commit_ledger.h"
#include "runtime/parts/gradient_ledger.h"
#include "runtime/parts/host_tasks.h"
#include "runtime/parts/layer_instances.h"
#include "runtime/parts/stats_recorder.h"
#include "runtime/parts/weight_table.h"
#include "runtime/planning/layer_timings.h"
#include "runtime/stage/device_worker.h"
#include "runtime/stage/stage_runner.h"

namespace roundpipe::testing {

using detail::CallState;
using detail::JobKind;

class StageFixture {
 public:
  explicit StageFixture(const torch::nn::Sequential& model, const std::string& device = "sim:1")
      : layers(layers_of(model)),
        pool(make_devices(device)),
        weights(layers, PinMode::kAlloc, pool.at(0)->supports_pinned_memory(), "stage test"),
        timings(static_cast<int>(layers.size())),
        instances(layers),
        context{name,
                layers,
                weights,
                instances,
                timings,
                host_tasks,
                grad_tasks,
                grads,
                commits,
                stats,
                [this](const CallState&, const std::string&, const std::string&,
                       const std::string&) { ++out_of_memory_retries; },
                callers_loss},
        worker_context{this,
                       weights,
                       host_tasks,
                       stats,
                       in_flight,
                       [this](detail::Job& job, detail::DeviceWorker& w) {
                         detail::run_stage_job(context, job, w);
                       },
                       [this](detail::Job& job) { finished(job); }},
        worker(std::make_unique<detail::DeviceWorker>(worker_context, pool.at(0))) {}

  ~StageFixture() { worker.reset(); }  // its threads first: they use the parts

  // A call over `input` in `n` microbatches on `plan`, set up as
  // Engine::start_call does (`label`: a fused call's, split as the input is).
  std::shared_ptr<CallState> call(const at::Tensor& input, int n, ExecutePlan plan, bool training,
                                  bool fused, RecomputeGrain grain = RecomputeGrain::kStage,
                                  const at::Tensor& label = {}, LossFn loss_fn = nullptr) {
    auto c = std::make_shared<CallState>();
    c->id = calls++;
    c->config.num_microbatch = n;
    c->n = n;
    c->training = training;
    c->fused = fused;
    c->grain = grain;
    c->plan = std::move(plan);
    c->plan.validate(static_cast<int>(layers.size()), fused);
    c->call_seed = 1234 + c->id;
    c->wakers.push_back([this] { commits.wake(); });
    c->wakers.push_back([this] { grads.wake(); });
    c->wakers.push_back([this] { weights.wake(); });
    const auto microbatches = c->split_input(input, name);
    c->make_slots(static_cast<int>(layers.size()));
    c->put_inputs(microbatches);
    if (fused) {
      c->split_labels(label, name);
      c->loss_fn = std::move(loss_fn);
    }
    return c;
  }

  // Runs one job of `call` on the device, as Engine::dispatch sends it, and
  // waits for it and its host tasks.
  void run(const std::shared_ptr<CallState>& call, JobKind kind, LayerRange range) {
    auto job = std::make_shared<detail::Job>();
    job->kind = kind;
    job->range = range;
    job->call = call;
    std::set<int> seen;
    for (int l = range.begin; l < range.end; ++l) {
      for (int id : weights.layer_param_ids(l))
        if (seen.insert(id).second) job->param_ids.push_back(id);
    }
    weights.add_reads(job->param_ids, call->weights_version);
    if (kind != JobKind::kForward && call->training) {
      std::vector<int> trainable;
      for (int id : job->param_ids)
        if (weights.trainable(id)) trainable.push_back(id);
      grads.expect(call->grads, trainable);
    }
    if (kind != JobKind::kBackward) {
      for (int l = range.begin; l < range.end; ++l)
        if (!layers[l]->buffers().empty()) job->commit_layers.push_back(l);
      commits.expect(job->commit_layers, call->id);
      if (!job->commit_layers.empty()) ++call->commits_left;
    }
    call->work.begin();
    worker->submit(std::move(job));
    call->work.wait_none();
    host_tasks.drain();
    grad_tasks.drain();
  }

  // The slot's value (its copy landed).
  static c10::IValue value(const std::shared_ptr<detail::Slot>& slot) {
    EXPECT_TRUE(slot->ready);
    if (slot->event) slot->event->synchronize();
    return slot->value;
  }
  // The slot's first tensor (a gradient, a loss), by value.
  static at::Tensor tensor(const std::shared_ptr<detail::Slot>& slot) {
    EXPECT_TRUE(slot->ready);
    if (slot->event) slot->event->synchronize();
    return slot->tensors.empty() ? at::Tensor() : slot->tensors.front();
  }

  // The call's parameter gradients by the name of their parameter.
  std::map<std::string, at::Tensor> gradients(CallState& call) {
    std::map<std::string, at::Tensor> named;
    for (auto& [id, grad] : grads.take(call.grads)) named[weights.name(id)] = grad;
    return named;
  }

  std::string name = "stage test";
  std::vector<LayerPtr> layers;
  DevicePool pool;
  detail::WeightTable weights;
  detail::LayerTimings timings;
  detail::LayerInstances instances;
  detail::StatsRecorder stats;
  detail::CommitLedger commits;
  detail::GradientLedger grads;
  detail::HostTasks host_tasks{this};
  detail::HostTasks grad_tasks{this};
  std::atomic<int> out_of_memory_retries{0};
  std::atomic<int> callers_loss{detail::kCallersLossUnknown};
  detail::StageContext context;
  detail::WorkCounter in_flight;
  detail::WorkerContext worker_context;
  std::unique_ptr<detail::DeviceWorker> worker;
  int64_t calls = 0;

 private:
  void finished(detail::Job& job) {  // Engine::job_finished
    if (!job.reads_released) {
      job.reads_released = true;
      weights.release_reads(job.param_ids, job.call->weights_version);
    }
    if (!job.commit_posted) commits.settle(job.commit_layers, job.call->id);
    job.call->work.end();
  }
};

}  // namespace roundpipe::testing

// RoundPipe: train a torch::nn::Sequential larger than GPU memory. Model
// state lives in CPU memory; stages are dispatched round-robin to a pool of
// stateless devices; activations are recomputed in backward.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/errors.h"
#include "roundpipe/execute_plan.h"
#include "roundpipe/layer.h"
#include "roundpipe/microbatch.h"
#include "roundpipe/optim/adam.h"
#include "roundpipe/optim/grad_clip.h"
#include "roundpipe/optim/grad_scaler.h"
#include "roundpipe/options.h"
#include "roundpipe/planner.h"
#include "roundpipe/recompute.h"
#include "roundpipe/run_config.h"

namespace roundpipe {

namespace detail {
class Engine;
}

// Whether the calling thread is one of a RoundPipe's own (a device worker
// or uploader, a host-task or the optimizer thread): code that a RoundPipe
// runs (layers, loss and step functions) runs there.
bool on_roundpipe_thread();

class RoundPipe {
 public:
  // Each child of `model` becomes one scheduled layer. The model's
  // parameters stay the home of the weights (pinned in place per pin_model).
  explicit RoundPipe(torch::nn::Sequential model, RoundPipeOptions options = {});
  RoundPipe(std::vector<LayerPtr> layers, RoundPipeOptions options = {});
  // Finishes pending work and publishes a pending async update, as
  // synchronize() does (an error nobody collected is printed to stderr).
  ~RoundPipe();
  RoundPipe(const RoundPipe&) = delete;
  RoundPipe& operator=(const RoundPipe&) = delete;

  // Runs the model on CPU inputs; returns the merged outputs on
  // output_device. With requires_grad (default: grad mode), the outputs are
  // connected to autograd: backward() on them runs the backward stages,
  // accumulates parameter gradients (see synchronize()) and fills the
  // gradients of inputs that require grad.
  c10::IValue forward(const c10::IValue& input, const RunConfig& config = {});
  at::Tensor forward(const at::Tensor& input, const RunConfig& config = {});

  // Fused training call: per microbatch forward, loss_fn, backward; the last
  // backward stage does all three without recompute. Returns once the losses
  // are known; the remaining backward stages run on in the background,
  // overlapping the next call (which waits only for this call's buffer
  // writes); synchronize() waits for them. Their errors reach the caller at
  // the next call, step() or synchronize().
  ForwardBackwardResult forward_backward(const c10::IValue& input, const c10::IValue& label,
                                         const LossFn& loss_fn, bool return_outputs = false,
                                         const RunConfig& config = {});

  // Waits for all background work (pending steps included), publishes the
  // latest master weights into the model, and adds the gradients of calls no
  // step() consumed into the parameters' .grad().
  void synchronize();

  // Waits for all background work like synchronize(), but publishes
  // nothing: after an async step the model's weights stay one update behind
  // the masters, as the next call will read them. Returns whether the
  // masters hold an update the weights do not have yet. This is how a
  // checkpoint is taken without changing what is trained (synchronize()
  // would give the next call fresher weights than it would otherwise see).
  bool wait_for_background_work();
  // For resuming from such a checkpoint: the masters (just restored) hold
  // one update more than the model's weights; the next step() or
  // synchronize() publishes it first, exactly as in the run that saved it.
  void restore_pending_update();

  // The optimizer's master copies (optim_dtype) of the parameters that
  // require grad, created on first use; shared parameters appear once,
  // frozen ones not at all. Build the optimizer on these. With
  // DataParallelOptions::shard_optimizer_state: this process's share only.
  std::vector<at::Tensor> optim_parameters();
  // The same, named "<layer index>.<parameter name in the layer>".
  std::vector<std::pair<std::string, at::Tensor>> optim_named_parameters();

  // Queues an optimizer step on the optimizer thread: the gradients of the
  // calls since the last step are added into the masters' .grad(), then
  // step_fn runs (typically optimizer.step(); optimizer.zero_grad()), then
  // the masters are published into the model's weights, parameter by
  // parameter in forward order, each as soon as no running job still reads
  // the old value. Async (default): returns at once, and the next calls run
  // on the weights of the update before this one (exactly one step of
  // staleness). Sync: returns after publishing, so the next call sees this
  // step. An exception thrown by step_fn reaches the caller (async: at the
  // next step(), call or synchronize()). What step_fn (or the Adam of the
  // fused step) refers to must outlive the step: synchronize() before
  // destroying it. step_fn must not call this RoundPipe's blocking methods
  // (synchronize(), step(), forward(), forward_backward()): it runs on the
  // optimizer thread they would wait for, so they throw there.
  void step(std::function<void()> step_fn, bool is_async = true);
  // The fused fast path: `adam` (built on optim_parameters(), fp32 masters)
  // updates each master from the low-precision gradient and writes the new
  // low-precision weight in the same pass over memory. Same numbers and the
  // same staleness as step([&] { adam.step(); adam.zero_grad(); }, is_async).
  // With a GradScaler, the gradients are unscaled and checked first and the
  // step is skipped on inf/NaN, as scaler.step(adam) would. With a
  // GradClipper, the gradients are clipped by their global norm (over all
  // stages, microbatches and calls of the step) before the update, as
  // clip_grad_norm_ then adam.step() would; such a step waits for every
  // gradient of the step before it updates anything.
  void step(optim::Adam& adam, bool is_async = true, optim::GradScaler* scaler = nullptr,
            optim::GradClipper* clip = nullptr);
  // The fused path with an optimizer of the caller's (the Python package's
  // roundpipe.optim.Adam): `update` gets the masters with a gradient, their
  // low-precision gradients and where each new low-precision weight goes,
  // once every gradient of the step is final (optim::FusedUpdate). The
  // staleness of step(step_fn, is_async); the masters' .grad stay untouched.
  void step(optim::FusedUpdate update, bool is_async = true);

  std::vector<at::Tensor> parameters() const;  // unique, in layer order
  // Named "<layer index>.<name in the layer>" (tied weights: first use).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_buffers() const;
  int num_layers() const;
  const DevicePool& devices() const;
  const std::string& name() const;
  // The plan a call without execute_plan uses.
  ExecutePlan default_plan(bool fused) const;
  // The automatic plan for `num_microbatches` with its predicted stage
  // times and memory; throws naming the smallest feasible memory limit.
  // `tail_rows`: the rows of a microbatch whose loss adds up over rows
  // (RunConfig::loss_sums_over_rows), which the fused tail may split.
  PlanEstimate auto_plan(bool fused, int num_microbatches, int min_stages = 0,
                         std::optional<double> memory_limit_gib = std::nullopt,
                         int tail_rows = 0) const;
  std::optional<c10::ScalarType> optim_dtype() const;
  // The data-parallel options it was built with (none: one process).
  const DataParallelOptions* data_parallel() const;
  HostMemoryStats host_memory_stats() const;
  PipelineStats pipeline_stats() const;
  // For benchmarks of pin_model: uploads every layer's weights once to the
  // first device from where they live, as stage jobs do (pinned, or through
  // the staging ring), and returns the bytes per second, wall clock. Waits
  // for the pipeline to be idle first (synchronize()).
  double measure_weight_upload_rate();

 private:
  std::unique_ptr<detail::Engine> engine_;
};

// RAII: declared after the optimizer, scaler and clipper that queued steps
// refer to, it waits for those steps when it goes out of scope, before they
// are destroyed. Without it, an exception that leaves a training loop with
// an asynchronous step queued destroys them under the running step. Errors
// of the background work are dropped here (an exception is usually on its
// way already): synchronize() reports them on a normal exit.
class StepsGuard {
 public:
  explicit StepsGuard(RoundPipe& pipe) : pipe_(pipe) {}
  ~StepsGuard() {
    try {
      pipe_.wait_for_background_work();
    } catch (...) {
    }
  }
  StepsGuard(const StepsGuard&) = delete;
  StepsGuard& operator=(const StepsGuard&) = delete;

 private:
  RoundPipe& pipe_;
};

}  // namespace roundpipe

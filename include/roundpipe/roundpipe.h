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
#include "roundpipe/host_arena.h"
#include "roundpipe/layer.h"
#include "roundpipe/microbatch.h"
#include "roundpipe/optim/adam.h"
#include "roundpipe/optim/grad_scaler.h"
#include "roundpipe/planner.h"
#include "roundpipe/recompute.h"
#include "roundpipe/run_config.h"

namespace roundpipe {

namespace detail {
class Engine;
}

enum class PinMode {
  kAlloc,     // copy model state into pinned host memory (fastest transfers)
  kRegister,  // pin the existing storage in place (CUDA only; ~1x memory)
  kOff,       // leave host memory pageable (e.g. mmap-loaded weights)
};
PinMode pin_mode_from_string(const std::string& text);
// float32/fp32, bfloat16/bf16, float16/fp16 (command lines, configs).
c10::ScalarType dtype_from_string(const std::string& text);

struct RoundPipeOptions {
  // dtype of the optimizer's master copies; default: the parameter dtype.
  std::optional<c10::ScalarType> optim_dtype;
  PinMode pin_model = PinMode::kAlloc;
  RunConfig model_run_config;
  std::string name;  // for messages; default "RoundPipe"
  // Device spec (see make_devices); empty: $ROUNDPIPE_DEVICES, else all GPUs
  // if any, else one simulated device. Ignored when `device_list` is set.
  std::string devices;
  std::vector<DevicePtr> device_list;
  // Device memory (GiB) the automatic plan may use per device; default: 90%
  // of what the smallest device had left when the RoundPipe was made. A
  // stage fits with its parameters, gradients and the activations its
  // layers were measured to keep for backward, plus the next stage's
  // parameters arriving meanwhile (half the limit is held back for the
  // activations until they are measured).
  std::optional<double> model_memory_limit_gib;
  bool verbose = false;  // log the automatic plan with its predicted stage times

  RoundPipeOptions& set_optim_dtype(c10::ScalarType v) {
    optim_dtype = v;
    return *this;
  }
  RoundPipeOptions& set_pin_model(PinMode v) {
    pin_model = v;
    return *this;
  }
  RoundPipeOptions& set_model_run_config(RunConfig v) {
    model_run_config = std::move(v);
    return *this;
  }
  RoundPipeOptions& set_name(std::string v) {
    name = std::move(v);
    return *this;
  }
  RoundPipeOptions& set_devices(std::string v) {
    devices = std::move(v);
    return *this;
  }
  RoundPipeOptions& set_device_list(std::vector<DevicePtr> v) {
    device_list = std::move(v);
    return *this;
  }
  RoundPipeOptions& set_model_memory_limit_gib(double v) {
    model_memory_limit_gib = v;
    return *this;
  }
  RoundPipeOptions& set_verbose(bool v) {
    verbose = v;
    return *this;
  }
};

// Whether the calling thread is one of a RoundPipe's own (a device worker
// or uploader, a host-task or the optimizer thread): code that a RoundPipe
// runs (layers, loss and step functions) runs there.
bool on_roundpipe_thread();

// loss_fn(output of the last layer, label) -> a 0-dim loss, run on the
// device for every microbatch.
using LossFn = std::function<at::Tensor(const c10::IValue& output, const c10::IValue& label)>;

// Host memory of a RoundPipe. With pin_model=alloc the parameters' home
// copies, the fused optimizer's staging copies and every download (gradients,
// activations) are blocks of one HostArena (pinned on CUDA; pageable on
// simulated devices); with register or off the arena stays empty.
struct HostMemoryStats {
  HostArenaStats arena;
  // Bytes of the parameters' home copies (shared storages once; with alloc,
  // what the arena's first, exact-size chunk was reserved for, before rounding).
  int64_t model_state_bytes = 0;
};

// Where the engine's threads spent their wall time since it was built, in
// seconds: what a slow pipeline waits for. Workers waiting for weights wait
// for the optimizer (its update, or its publish behind the previous call's
// uploads); a call start waits for the earlier calls' forward work to land.
struct PipelineStats {
  int64_t optimizer_updates = 0;
  double optimizer_update_seconds = 0;     // the update itself (e.g. the Adam pass)
  double optimizer_grad_wait_seconds = 0;  // waiting for the calls' last gradients
  double optimizer_publish_seconds = 0;    // publishing weights, readers of the old ones included
  double weight_wait_seconds = 0;          // workers waiting for published weights (all devices)
  double call_start_wait_seconds = 0;      // new calls waiting for earlier calls
};

struct ForwardBackwardResult {
  at::Tensor loss;     // sum of the microbatch losses (CPU, 0-dim)
  c10::IValue output;  // merged outputs when asked for, else None
};

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
  // frozen ones not at all. Build the optimizer on these.
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
  // step is skipped on inf/NaN, as scaler.step(adam) would.
  void step(optim::Adam& adam, bool is_async = true, optim::GradScaler* scaler = nullptr);

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
  PlanEstimate auto_plan(bool fused, int num_microbatches, int min_stages = 0,
                         std::optional<double> memory_limit_gib = std::nullopt) const;
  std::optional<c10::ScalarType> optim_dtype() const;
  HostMemoryStats host_memory_stats() const;
  PipelineStats pipeline_stats() const;

 private:
  std::unique_ptr<detail::Engine> engine_;
};

}  // namespace roundpipe

// The option, loss-function and statistics types of RoundPipe: what a caller
// passes to RoundPipe's constructor and calls, and what it gets back. The
// runtime builds on these types without including roundpipe.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/run_config.h"

namespace roundpipe {

enum class PinMode {
  kAlloc,     // copy model state into pinned host memory (fastest transfers)
  kRegister,  // pin the existing storage in place (CUDA only; ~1x memory)
  kOff,       // leave host memory pageable (e.g. mmap-loaded weights)
};
PinMode pin_mode_from_string(const std::string& text);
struct DataParallelOptions;  // roundpipe/data_parallel_options.h

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
  // activations until they are measured; three quarters in a first
  // forward_backward under the default limit or this one).
  std::optional<double> model_memory_limit_gib;
  // Host memory (GiB) a training call's activation checkpoints may take
  // where the automatic plan chooses the grain; default: three quarters of
  // what the host has available when the plan is made (MemAvailable and
  // the pinned arena's free blocks). Where layer grain's (every layer's
  // input) would not fit, calls run in layer-from-stage grain (Note [Thin
  // checkpoints], Note [Host room for checkpoints]).
  std::optional<double> host_checkpoint_limit_gib;
  bool verbose = false;  // log the automatic plan with its predicted stage times
  // Data parallel across processes (roundpipe/distributed.h): each step
  // averages the gradients over the group's processes; none: this process
  // alone.
  std::shared_ptr<const DataParallelOptions> data_parallel;

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
  RoundPipeOptions& set_host_checkpoint_limit_gib(double v) {
    host_checkpoint_limit_gib = v;
    return *this;
  }
  RoundPipeOptions& set_verbose(bool v) {
    verbose = v;
    return *this;
  }
  RoundPipeOptions& set_data_parallel(const DataParallelOptions& v);  // in distributed.cpp
};

// loss_fn(output of the last layer, label) -> a 0-dim loss, run on the
// device for every microbatch.
using LossFn = std::function<at::Tensor(const c10::IValue& output, const c10::IValue& label)>;
// Whether the loss function now running gives the microbatch's reported
// loss. Where the fused tail runs a microbatch in chunks of rows, a loss
// function of the caller's is also called on each chunk's output, for its
// gradient there (Note [A caller's loss over row chunks]); this is false
// in those calls, so that one with side effects (recording its values)
// can skip them.
bool loss_value_is_reported();

// Host memory held by a HostArena (the engine's pinned host memory, see
// HostMemoryStats).
struct HostArenaStats {
  int64_t reserved_bytes = 0;        // all chunks
  int64_t pinned_bytes = 0;          // chunks the driver pinned
  int64_t allocated_bytes = 0;       // live blocks (requests rounded to the alignment)
  int64_t peak_allocated_bytes = 0;  // the most allocated_bytes has been
  int64_t live_blocks = 0;
  int64_t chunks = 0;
};

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
  // Fused-tail microbatches run in chunks of rows (Note [Tail row chunks]).
  int64_t tail_microbatches_in_row_chunks = 0;
  // Calls redone with whole microbatches: the caller's loss function failed
  // its check on chunks of rows (Note [A caller's loss over row chunks]).
  int64_t calls_redone_for_the_loss_check = 0;
  // Parameter uploads that ran out of device memory and were retried once
  // the device's earlier jobs had finished (Note [Upload out of memory]).
  int64_t upload_out_of_memory_retries = 0;
  // Calls redone and microbatches retried after the device ran out of
  // memory (Note [Out-of-memory redo]); each also prints a warning. A plan
  // that fits the first time keeps it at 0.
  int64_t out_of_memory_recoveries = 0;
  // Training calls that kept only each backward stage's input on the host
  // (layer-from-stage grain, asked for or chosen where the host is short:
  // Note [Host room for checkpoints]).
  int64_t calls_with_thin_checkpoints = 0;
  // The plan the latest training call without an execute_plan of its own
  // chose (a call with one leaves it as it was): its largest stage's
  // predicted memory with the next stage's parameters (PlanEstimate's
  // peak_bytes), beside which the device's peak is read; 0 before such a
  // call.
  int64_t last_call_planned_peak_bytes = 0;
};

struct ForwardBackwardResult {
  at::Tensor loss;     // sum of the microbatch losses (CPU, 0-dim)
  c10::IValue output;  // merged outputs when asked for, else None
};

}  // namespace roundpipe

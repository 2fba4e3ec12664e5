// Data parallel across processes on PyTorch's c10d: each process runs its
// own RoundPipe on its own share of every batch, and each step averages
// the gradients over the processes of a c10d process group (the mean over
// ranks, as DDP's) before the optimizer uses them. See Note [Data parallel
// steps] in src/runtime/gradient_averager.h for when the reductions run.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace roundpipe {

// Every process must call step() as often as the others (each step's
// reductions pair up across processes in order). Gradients that no step
// consumed, which synchronize() leaves in the parameters' .grad(), are this
// process's own, not averaged.
struct DataParallelOptions {
  // The processes that train together; every one of them builds the same
  // model from the same weights and steps in lockstep with the others.
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  // The dtype of the gradients on the network. float32 (default) adds the
  // processes' gradients exactly as one process adds its microbatches';
  // bfloat16 sends half the bytes, each share rounded to 8 bits of
  // mantissa (the gradients of a bf16 model already are).
  c10::ScalarType reduce_dtype = c10::kFloat;
  // Gradients are reduced in buckets of about this many bytes (on the
  // network), deepest layers first, each as soon as every gradient in it is
  // final: the reduction overlaps the rest of the backward.
  int64_t bucket_bytes = int64_t{25} << 20;
  // ZeRO's stage 1 on the host, masters included: each process keeps the
  // optimizer's masters and moments of about 1/N of the trainable
  // parameters' bytes (optim_parameters() gives only those: build the
  // optimizer on them). A step reduces each gradient bucket to its owner
  // only, the owner updates it, and sends the new weights (in the model's
  // dtype) to the others. See Note [Sharded optimizer state].
  bool shard_optimizer_state = false;

  explicit DataParallelOptions(c10::intrusive_ptr<c10d::ProcessGroup> group);

  DataParallelOptions& set_reduce_dtype(c10::ScalarType v) {
    reduce_dtype = v;
    return *this;
  }
  DataParallelOptions& set_bucket_bytes(int64_t v) {
    bucket_bytes = v;
    return *this;
  }
  DataParallelOptions& set_shard_optimizer_state(bool v) {
    shard_optimizer_state = v;
    return *this;
  }
  int rank() const;
  int world_size() const;
};

// The launch environment of torchrun (or any launcher that sets the same
// variables): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
struct LaunchEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  // processes on this node
  std::string master_addr;
  int master_port = 0;
  bool agent_store = false;  // torchrun's agent already serves the store
  int restart_count = 0;
  // Read from the process's environment; world_size 1 when unset.
  static LaunchEnvironment from_environment();
  bool distributed() const { return world_size > 1; }
};

// A process group over Gloo (CPU tensors, any network) for the processes
// of `env`, on the TCP store at its MASTER_ADDR:MASTER_PORT. `name` keeps
// apart several groups of the same processes (each its own connections;
// collectives of one group must be issued in the same order on every
// process, so threads that issue collectives independently each need their
// own group). A collective that waits longer than `timeout` (a process
// died, or stopped calling) fails with an error naming the group.
// Throws where roundpipe was built without gloo's headers.
c10::intrusive_ptr<c10d::ProcessGroup> new_gloo_group(
    const LaunchEnvironment& env, const std::string& name,
    std::chrono::milliseconds timeout = std::chrono::minutes(30));

// Collectives the training loop needs besides the gradients' (on a group
// of its own). Sums `values` (float64, on the CPU) over the group, in place.
void all_reduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor& values);
// Waits until every process of the group got here.
void barrier(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

}  // namespace roundpipe

// Data parallel across processes on PyTorch's c10d: each process runs its
// own RoundPipe on its own share of every batch, and each step averages
// the gradients over the processes of a c10d process group (the mean over
// ranks, as DDP's) before the optimizer uses them. See Note [Data parallel
// steps] in src/runtime/parallel/gradient_averager.h for when the reductions run.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "roundpipe/data_parallel_options.h"

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace roundpipe {

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

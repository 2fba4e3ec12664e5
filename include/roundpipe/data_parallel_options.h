// DataParallelOptions: how a RoundPipe trains together with other processes
// over a c10d process group (RoundPipeOptions::set_data_parallel). The
// options alone, defined with the runtime that reads them
// (src/runtime/parallel/); roundpipe/distributed.h has the process groups
// and the launch environment.
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>

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

}  // namespace roundpipe

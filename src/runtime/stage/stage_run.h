// One stage job as it runs: its progress (for errors), binding and
// transfers, timer and out-of-memory retry, and the compute that uses them,
// in a file per job: the forward stage and the layer step
// (stage_forward.cpp), a microbatch's steps and the backward stage
// (stage_backward.cpp), the fused tail (stage_tail.cpp) and its row chunks
// (row_chunks.cpp, chunk_loss_check.cpp). run_stage_job (stage_runner.cpp)
// makes one and turns its errors into the call's. Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <vector>

#include "runtime/parts/call.h"
#include "runtime/planning/microbatch_steps.h"
#include "runtime/recovery/out_of_memory.h"
#include "runtime/stage/stage_binding.h"
#include "runtime/stage/stage_runner.h"
#include "runtime/stage/stage_timer.h"
#include "runtime/values/rng.h"

namespace roundpipe::detail {

// The loss end of a fused tail's microbatch: the label, and where the loss
// and output go once the forward is done (before the backward is enqueued:
// the caller has them, and may issue the next call, while the backward
// still runs). Sent once, also across a retry.
struct ChunkLossCheck;
struct TailResults {
  const c10::IValue& label;
  std::function<void(const at::Tensor& loss, const c10::IValue& output)> send;
  bool sent = false;
  ChunkLossCheck* check = nullptr;  // a caller's loss over chunks of rows, checked
};

// Note [A caller's loss over row chunks] (chunk_loss_check.cpp): one
// microbatch's chunks, what the loss function gave at each.
struct ChunkLossCheck {
  int chunks = 0;
  int chunk = 0;                 // the one running
  c10::IValue label;             // the microbatch's, on the device
  c10::IValue detached;          // the first chunk's output, detached: the structure
  std::vector<bool> needs_grad;  // per output tensor: it depends on parameters
  std::vector<std::vector<at::Tensor>> outputs, grads;  // per chunk, per output tensor
};

struct StageRun {
  StageRun(const StageContext& context, Job& job, DeviceWorker& worker);

  const StageContext& ctx;
  Job& job;
  DeviceWorker& worker;
  Device& device;
  CallState& call;
  StageProgress where;
  StageBinding binding;
  StageTimer timer;
  OutOfMemoryRetry retry;

  // The job: uploads, its microbatches, then buffer commits and gradients.
  void run();

  // stage_forward.cpp: a forward stage; one layer's forward (`recompute`:
  // repeating one; `metered`: its memory measured for the plan).
  void run_forward();
  c10::IValue run_layer(int layer, const c10::IValue& x, bool recompute, bool metered);

  // stage_backward.cpp: a backward stage; one microbatch's steps from the
  // stage input `input` (on the device) and the random state it started
  // from. The backward starts from `output_grads` (a backward stage) or the
  // loss (`tail`). `leaves`: the stage input's gradient leaves.
  void run_backward();
  void run_steps(const MicrobatchSteps& steps, const c10::IValue& input, const RngState& rng_start,
                 const std::vector<at::Tensor>& output_grads, TailResults* tail,
                 std::vector<at::Tensor>& leaves);
  void run_each_layer_from_its_input(const MicrobatchSteps& steps,
                                     std::vector<at::Tensor> output_grads,
                                     std::vector<at::Tensor>& leaves);
  // Runs `steps` for the current microbatch with `run_one`, retrying it by
  // layer where it runs out of memory (out_of_memory.h).
  void run_retrying(const MicrobatchSteps& steps,
                    const std::function<void(const MicrobatchSteps&)>& run_one);
  // The current microbatch's hand-offs this stage read last (its layers'
  // inputs, its output gradient) go back (Note [Hand-offs end with their
  // last reader] in call.h).
  void release_read_hand_offs();

  // stage_tail.cpp: the fused tail.
  void run_tail();
  at::Tensor run_loss(const c10::IValue& output, TailResults& tail);
  // chunk_loss_check.cpp: Note [A caller's loss over row chunks]. The
  // first learns, on a whole microbatch's output, whether the caller's loss
  // function may run on chunks; the second runs it on one chunk's, and
  // checks it at the last, returning the root to backpropagate.
  void learn_callers_loss(const c10::IValue& output, const c10::IValue& label);
  at::Tensor run_checked_loss(const c10::IValue& output, TailResults& tail);
  // row_chunks.cpp: one microbatch of the tail in chunks of rows (Note
  // [Tail row chunks]); false where its first layer cannot split this input.
  bool run_tail_in_chunks(Slot& in, int with_grad);

 private:
  struct SavedInput {   // a layer's input kept for its recompute
    c10::IValue value;  // on the host (`event`: its download), or the device's own
    EventPtr event;
    RngState rng;
    bool on_device = false;
  };
  std::vector<SavedInput> run_keeping_inputs(int begin, int end, c10::IValue& x, RngScope& rng,
                                             const MicrobatchSteps& steps);
  void backward_layer_by_layer(int first, std::vector<SavedInput>& saved,
                               std::vector<at::Tensor>& leaves, bool metered);
  void layer_backward(int layer, const c10::IValue& y, const std::vector<at::Tensor>& grads,
                      bool metered);
  void shared_backward(int first, const c10::IValue& y, const std::vector<at::Tensor>& grads);
  c10::IValue input_leaves(const c10::IValue& x, int layer, std::vector<at::Tensor>& leaves);
};

// The gradients of autograd leaves (undefined where a leaf needs none).
std::vector<at::Tensor> leaf_grads(const std::vector<at::Tensor>& leaves);

}  // namespace roundpipe::detail

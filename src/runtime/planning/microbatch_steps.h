// What one microbatch of a backward stage or of the fused tail runs, as
// data: which layers run without grad (their inputs kept on the host, to be
// recomputed one at a time), which with grad, whether a loss follows, and
// how the backward goes. The stage runner executes it (stage_backward.cpp);
// which steps a job's microbatch takes, and what an out-of-memory retry
// takes instead, are pure functions tested without devices
// (tests/runtime/planning/microbatch_steps_test.cpp). Internal header.
#pragma once

#include <string>

#include "roundpipe/execute_plan.h"
#include "roundpipe/run_config.h"

namespace roundpipe::detail {

// How the layers that run with grad are backpropagated.
enum class BackwardKind {
  kShared,     // one backward through them all, its time shared by them
  kLastLayer,  // they are one layer: a backward of that layer, timed and metered
};

struct MicrobatchSteps {
  LayerRange layers;
  // Layer-grain backward stage: each layer, last first, recomputed with
  // grad from its own input (which the forward stage kept in the call's
  // slots) and backpropagated. The fields below do not apply.
  bool each_layer_from_its_input = false;
  // From the stage's input: layers [begin, first_with_grad) run without
  // grad, each one's input kept on the host with its random state; layers
  // [first_with_grad, end) run with grad (then the loss, for the tail) and
  // are backpropagated as `backward` says; then the kept layers are
  // recomputed with grad one at a time, last first, and backpropagated.
  int first_with_grad = 0;
  // Those inputs stay on the device, referenced, instead of going to the
  // host and back (layer-from-stage grain once the plan counts them on the
  // device, Note [Thin checkpoints]; a retry by layer keeps them on the
  // host again).
  bool inputs_on_device = false;
  bool recompute = true;  // the forward pass repeats a forward (a backward stage)
  bool loss = false;      // the fused tail: loss_fn after the last layer
  BackwardKind backward = BackwardKind::kShared;
  // Its memory is metered for the plan (not in a chunk of a microbatch's
  // rows, Note [Tail row chunks]: the plan's figures are per microbatch).
  bool metered = true;

  int layers_with_grad() const { return layers.end - first_with_grad; }
  // "layers 2..5: 2..4 without grad (inputs kept), 5 with grad, loss,
  // backward of 5, then 4, 3, 2 recomputed one at a time", for traces and tests.
  std::string describe() const;
  bool operator==(const MicrobatchSteps&) const = default;
};

// A backward stage's microbatch: in layer grain each layer from its own
// input; in stage grain all layers recomputed with grad, one backward; in
// layer-from-stage grain from the stage's input, one layer with grad at a
// time (by_layer's steps), the inputs of the layers rerun kept on the
// device where `inputs_on_device`.
MicrobatchSteps backward_stage_steps(LayerRange layers, RecomputeGrain grain,
                                     bool inputs_on_device = false);

// A fused tail's microbatch, its last `with_grad` layers with grad (stage
// grain: all of them), backpropagated at once, their gradients added in
// place (Note [Tail grain]). `row_chunk`: a chunk of a microbatch's rows
// (Note [Tail row chunks]), not metered.
MicrobatchSteps tail_steps(LayerRange layers, int with_grad, bool row_chunk);

// The tail's layers with grad: all of them in stage grain; otherwise the
// plan's count (Note [Tail grain]), at least one, at most all.
int tail_layers_with_grad(LayerRange layers, RecomputeGrain grain, int planned);

// What a microbatch that ran out of memory runs again (Note [Out-of-memory
// retry of a microbatch]), and what the rest of its job runs: one layer's
// activations at a time, from the stage's input, the last layer alone
// with grad, the other layers' inputs kept on the host. A layer-grain backward keeps its own steps
// for later microbatches (they already hold one layer at a time) but retries by layer.
MicrobatchSteps by_layer(const MicrobatchSteps& steps);
MicrobatchSteps after_out_of_memory(const MicrobatchSteps& steps);

}  // namespace roundpipe::detail

// A microbatch's steps as data: see microbatch_steps.h.
#include "runtime/planning/microbatch_steps.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace roundpipe::detail {

namespace {

// "3" or "3..5" (inclusive, as ScheduledJob::describe names layers).
std::string layer_span(int first, int last) {
  return first == last ? std::to_string(first)
                       : std::to_string(first) + ".." + std::to_string(last);
}

}  // namespace

std::string MicrobatchSteps::describe() const {
  std::string text = "layers " + layer_span(layers.begin, layers.end - 1) + ": ";
  if (each_layer_from_its_input) return text + "each from its own input with grad, last first";
  if (first_with_grad > layers.begin)
    text += "without grad " + layer_span(layers.begin, first_with_grad - 1) +
            (inputs_on_device ? " (inputs kept on the device), " : " (inputs kept), ");
  text += "with grad " + layer_span(first_with_grad, layers.end - 1);
  if (recompute) text += " (a recompute)";
  if (loss) text += ", loss";
  switch (backward) {
    case BackwardKind::kShared:
      text += ", one backward";
      break;
    case BackwardKind::kLastLayer:
      text += ", backward of layer " + std::to_string(layers.end - 1);
      break;
  }
  if (first_with_grad > layers.begin)
    text += ", then " + layer_span(first_with_grad - 1, layers.begin) + " recomputed one at a time";
  if (!metered) text += " (not metered)";
  return text;
}

MicrobatchSteps backward_stage_steps(LayerRange layers, RecomputeGrain grain,
                                     bool inputs_on_device) {
  TORCH_CHECK(layers.size() > 0, "a backward stage needs at least one layer");
  MicrobatchSteps steps;
  steps.layers = layers;
  steps.each_layer_from_its_input = grain == RecomputeGrain::kLayer;
  steps.first_with_grad = layers.begin;
  steps.recompute = true;
  steps.backward = BackwardKind::kShared;
  // From the stage's input, its last layer alone with grad: the steps of a
  // retry by layer (Note [Thin checkpoints]).
  if (grain != RecomputeGrain::kLayerFromStage) return steps;
  auto thin = by_layer(steps);
  thin.inputs_on_device = inputs_on_device;
  return thin;
}

int tail_layers_with_grad(LayerRange layers, RecomputeGrain grain, int planned) {
  return grain == RecomputeGrain::kStage ? layers.size() : std::clamp(planned, 1, layers.size());
}

MicrobatchSteps tail_steps(LayerRange layers, int with_grad, bool row_chunk) {
  TORCH_CHECK(with_grad >= 1 && with_grad <= layers.size(), "the fused tail runs 1 to ",
              layers.size(), " of its layers with grad, not ", with_grad);
  MicrobatchSteps steps;
  steps.layers = layers;
  steps.first_with_grad = layers.end - with_grad;
  steps.recompute = false;
  steps.loss = true;
  steps.metered = !row_chunk;
  steps.backward = with_grad == 1 ? BackwardKind::kLastLayer : BackwardKind::kShared;
  return steps;
}

MicrobatchSteps by_layer(const MicrobatchSteps& steps) {
  MicrobatchSteps lighter = steps;
  lighter.each_layer_from_its_input = false;
  lighter.first_with_grad = steps.layers.end - 1;
  lighter.backward = BackwardKind::kLastLayer;
  lighter.inputs_on_device = false;
  return lighter;
}

MicrobatchSteps after_out_of_memory(const MicrobatchSteps& steps) {
  return steps.each_layer_from_its_input ? steps : by_layer(steps);
}

}  // namespace roundpipe::detail

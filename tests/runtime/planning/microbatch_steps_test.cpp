// A microbatch's steps as data (runtime/microbatch_steps.h), checked
// without devices: what a backward stage's or the fused tail's microbatch
// runs in each grain, and what it runs after running out of memory.
#include "runtime/planning/microbatch_steps.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace roundpipe::testing {
namespace {

using detail::BackwardKind;
using detail::MicrobatchSteps;

TEST(MicrobatchSteps, StageGrainBackwardRecomputesEveryLayerWithGradThenOneBackward) {
  const auto steps = detail::backward_stage_steps({2, 6}, RecomputeGrain::kStage);
  EXPECT_FALSE(steps.each_layer_from_its_input);
  EXPECT_EQ(steps.first_with_grad, 2);
  EXPECT_EQ(steps.layers_with_grad(), 4);
  EXPECT_TRUE(steps.recompute);
  EXPECT_FALSE(steps.loss);
  EXPECT_EQ(steps.backward, BackwardKind::kShared);
  EXPECT_TRUE(steps.metered);
  EXPECT_EQ(steps.describe(), "layers 2..5: with grad 2..5 (a recompute), one backward");
}

TEST(MicrobatchSteps, LayerGrainBackwardRunsEachLayerFromItsOwnInput) {
  const auto steps = detail::backward_stage_steps({2, 6}, RecomputeGrain::kLayer);
  EXPECT_TRUE(steps.each_layer_from_its_input);
  EXPECT_EQ(steps.describe(), "layers 2..5: each from its own input with grad, last first");
  // It already holds one layer's activations at a time: later microbatches
  // keep it after a retry...
  EXPECT_EQ(detail::after_out_of_memory(steps), steps);
  // ...but the retry itself runs from the stage input it still has.
  const auto retry = detail::by_layer(steps);
  EXPECT_FALSE(retry.each_layer_from_its_input);
  EXPECT_EQ(retry.first_with_grad, 5);
  EXPECT_EQ(retry.backward, BackwardKind::kLastLayer);
  EXPECT_TRUE(retry.recompute);
}

TEST(MicrobatchSteps, LayerFromStageGrainRunsFromTheStageInputOneLayerWithGradAtATime) {
  const auto steps = detail::backward_stage_steps({2, 6}, RecomputeGrain::kLayerFromStage);
  EXPECT_EQ(steps.describe(),
            "layers 2..5: without grad 2..4 (inputs kept), with grad 5 (a recompute), backward of "
            "layer 5, then 4..2 recomputed one at a time");
  EXPECT_EQ(steps, detail::by_layer(detail::backward_stage_steps({2, 6}, RecomputeGrain::kStage)));
  EXPECT_EQ(detail::after_out_of_memory(steps), steps);
  // Where the plan counts them, the rerun's inputs stay on the device; a
  // retry, and the microbatches after it, keep them on the host.
  const auto on_device =
      detail::backward_stage_steps({2, 6}, RecomputeGrain::kLayerFromStage, true);
  EXPECT_TRUE(on_device.inputs_on_device);
  EXPECT_EQ(on_device.describe(),
            "layers 2..5: without grad 2..4 (inputs kept on the device), with grad 5 (a "
            "recompute), backward of layer 5, then 4..2 recomputed one at a time");
  EXPECT_EQ(detail::by_layer(on_device), steps);
  EXPECT_EQ(detail::after_out_of_memory(on_device), steps);
  EXPECT_FALSE(detail::backward_stage_steps({2, 6}, RecomputeGrain::kStage, true).inputs_on_device);
  // Its tail runs the plan's count of layers with grad, as in layer grain.
  EXPECT_EQ(detail::tail_layers_with_grad({4, 8}, RecomputeGrain::kLayerFromStage, 2), 2);
  EXPECT_EQ(detail::tail_layers_with_grad({4, 8}, RecomputeGrain::kLayerFromStage, 0), 1);
  EXPECT_EQ(std::string(to_string(RecomputeGrain::kLayerFromStage)), "layer_from_stage");
  EXPECT_EQ(recompute_grain_from_string("layer_from_stage"), RecomputeGrain::kLayerFromStage);
  EXPECT_THROW(recompute_grain_from_string("block"), c10::Error);
}

TEST(MicrobatchSteps, AStageGrainRetryHoldsOneLayersActivationsAtATime) {
  const auto steps = detail::backward_stage_steps({0, 4}, RecomputeGrain::kStage);
  const auto retry = detail::by_layer(steps);
  EXPECT_EQ(retry.describe(),
            "layers 0..3: without grad 0..2 (inputs kept), with grad 3 (a recompute), backward of "
            "layer 3, then 2..0 recomputed one at a time");
  EXPECT_EQ(detail::after_out_of_memory(steps), retry);
  EXPECT_EQ(detail::by_layer(retry), retry);
}

TEST(MicrobatchSteps, TheTailInStageGrainRunsAllLayersWithGradAndTheLoss) {
  const int with_grad = detail::tail_layers_with_grad({4, 8}, RecomputeGrain::kStage, 2);
  EXPECT_EQ(with_grad, 4);  // stage grain ignores the plan's count
  const auto steps = detail::tail_steps({4, 8}, with_grad, /*row_chunk=*/false);
  EXPECT_EQ(steps.first_with_grad, 4);
  EXPECT_FALSE(steps.recompute);
  EXPECT_TRUE(steps.loss);
  EXPECT_EQ(steps.backward, BackwardKind::kShared);
  EXPECT_EQ(steps.describe(), "layers 4..7: with grad 4..7, loss, one backward");
}

TEST(MicrobatchSteps, TheTailInLayerGrainRunsSomeLayersWithGradInOneBackward) {
  // Note [Tail grain]: the plan's layers with grad, between one and all,
  // backpropagated at once (their gradients added in place), the rest
  // recomputed one at a time.
  EXPECT_EQ(detail::tail_layers_with_grad({4, 8}, RecomputeGrain::kLayer, 0), 1);
  EXPECT_EQ(detail::tail_layers_with_grad({4, 8}, RecomputeGrain::kLayer, 9), 4);
  const int with_grad = detail::tail_layers_with_grad({4, 8}, RecomputeGrain::kLayer, 2);
  const auto steps = detail::tail_steps({4, 8}, with_grad, /*row_chunk=*/false);
  EXPECT_EQ(steps.first_with_grad, 6);
  EXPECT_EQ(steps.backward, BackwardKind::kShared);
  EXPECT_TRUE(steps.metered);
  EXPECT_EQ(steps.describe(),
            "layers 4..7: without grad 4..5 (inputs kept), with grad 6..7, loss, one backward, "
            "then 5..4 recomputed one at a time");
  // One layer with grad: its own backward.
  EXPECT_EQ(detail::tail_steps({4, 8}, 1, false).backward, BackwardKind::kLastLayer);
  // The retry keeps the loss and runs its layers as a forward, not a recompute.
  const auto retry = detail::by_layer(steps);
  EXPECT_EQ(retry.first_with_grad, 7);
  EXPECT_TRUE(retry.loss);
  EXPECT_FALSE(retry.recompute);
  EXPECT_EQ(retry.backward, BackwardKind::kLastLayer);
}

TEST(MicrobatchSteps, ARowChunkIsNotMetered) {
  // Note [Tail row chunks]: the plan's figures are per microbatch.
  const auto steps = detail::tail_steps({4, 8}, 4, /*row_chunk=*/true);
  EXPECT_EQ(steps.backward, BackwardKind::kShared);
  EXPECT_FALSE(steps.metered);
  EXPECT_FALSE(detail::by_layer(steps).metered);
  EXPECT_EQ(detail::tail_steps({4, 8}, 1, true).backward, BackwardKind::kLastLayer);
  EXPECT_EQ(detail::tail_steps({4, 5}, 1, true).describe(),
            "layers 4: with grad 4, loss, backward of layer 4 (not metered)");
}

TEST(MicrobatchSteps, StepsOutsideTheStageAreRefused) {
  EXPECT_THROW(detail::tail_steps({4, 8}, 0, false), c10::Error);
  EXPECT_THROW(detail::tail_steps({4, 8}, 5, false), c10::Error);
  EXPECT_THROW(detail::backward_stage_steps({4, 4}, RecomputeGrain::kStage), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing

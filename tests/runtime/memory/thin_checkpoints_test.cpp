// Thin checkpoints (Note [Thin checkpoints], runtime/parts/call.cpp): what
// layer-from-stage grain keeps in the host arena against layer grain, with
// the same gradients (each grain against plain LibTorch: engine_test.cpp;
// the automatic choice of it: auto_plan_test.cpp).
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <string>
#include <vector>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

class ThinCheckpoints : public ::testing::TestWithParam<std::string> {};

// Note [Thin checkpoints]: in layer-from-stage grain the host keeps each
// backward stage's input, and the device a microbatch's layer inputs only
// while its backward stage runs it; layer grain keeps every layer's input
// of every microbatch on the host from the forward to the backward. Same
// gradients.
TEST_P(ThinCheckpoints, LayerFromStageGrainKeepsStageInputsOnly) {
  namespace nn = torch::nn;
  const int64_t rows = 4096, width = 12, n = 4;
  const int64_t layer_input = rows * width * 4;  // a hidden layer's input, all microbatches
  auto x = at::randn({rows, width}, at::detail::createCPUGenerator(11));
  auto y = at::randn({rows, 4}, at::detail::createCPUGenerator(12));
  // Seven layers in one forward stage and one backward stage (six hidden
  // inputs), the last two in the fused tail.
  const auto plan = ExecutePlan({{0, 7}}, {{7, 9}, {0, 7}});
  std::map<RecomputeGrain, int64_t> peak, device_peak, activation_uploads;
  std::map<RecomputeGrain, std::vector<at::Tensor>> grads;
  for (auto grain : {RecomputeGrain::kLayer, RecomputeGrain::kLayerFromStage}) {
    SCOPED_TRACE(to_string(grain));
    torch::manual_seed(3);
    auto model = nn::Sequential(nn::Linear(width, width), nn::Tanh(), nn::Linear(width, width),
                                nn::Tanh(), nn::Linear(width, width), nn::Tanh(),
                                nn::Linear(width, width), nn::Tanh(), nn::Linear(width, 4));
    RoundPipe pipe(model,
                   RoundPipeOptions().set_devices(GetParam()).set_pin_model(PinMode::kAlloc));
    const int64_t placed = pipe.host_memory_stats().arena.allocated_bytes;
    pipe.devices().at(0)->reset_peak_memory();
    int64_t uploaded = 0;
    for (int d = 0; d < pipe.devices().size(); ++d)
      uploaded -= pipe.devices().at(d)->transfer_stats().activation_upload_bytes;
    pipe.forward_backward(
        x, y, mse_loss, false,
        RunConfig().set_num_microbatch(n).set_recompute_grain(grain).set_execute_plan(plan));
    pipe.synchronize();
    peak[grain] = pipe.host_memory_stats().arena.peak_allocated_bytes - placed;
    device_peak[grain] = pipe.devices().at(0)->memory_stats().peak_bytes;
    for (int d = 0; d < pipe.devices().size(); ++d)
      uploaded += pipe.devices().at(d)->transfer_stats().activation_upload_bytes;
    activation_uploads[grain] = uploaded;
    for (const auto& p : model->parameters()) grads[grain].push_back(p.grad().clone());
  }
  // Layer grain: the six hidden inputs of all microbatches and the
  // forward's output, at least while the forward stage has just ended.
  EXPECT_GE(peak[RecomputeGrain::kLayer], 6 * layer_input);
  // Layer from stage: the forward's output, the gradients handed to the
  // backward stage, and the tail's one input of a microbatch kept for its
  // recompute (Note [Tail grain]) at most. The backward stage's rerun keeps
  // its six inputs (layers 0..5) of the microbatch it runs on the device
  // (the caller's plan: Note [Thin checkpoints]), all at once while layer
  // 6 runs with grad.
  EXPECT_LE(peak[RecomputeGrain::kLayerFromStage], 2 * layer_input + layer_input / n);
  EXPECT_GE(device_peak[RecomputeGrain::kLayerFromStage], 6 * layer_input / n);
  // So they never cross the link: layer grain uploads the six inputs of
  // every microbatch for its recompute (6 x layer_input), this grain none
  // of them (one input's worth of slack).
  EXPECT_LE(activation_uploads[RecomputeGrain::kLayerFromStage] + 5 * layer_input,
            activation_uploads[RecomputeGrain::kLayer]);
  for (size_t i = 0; i < grads[RecomputeGrain::kLayer].size(); ++i)
    EXPECT_TENSOR_NEAR(grads[RecomputeGrain::kLayerFromStage][i], grads[RecomputeGrain::kLayer][i],
                       1e-6, "parameter gradient " + std::to_string(i));
}

std::vector<std::string> backends() {
  std::vector<std::string> specs = {"sim:1", "sim:2"};
  if (cuda_device_count() > 0) specs.push_back("cuda");
  return specs;
}

INSTANTIATE_TEST_SUITE_P(Backends, ThinCheckpoints, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

}  // namespace
}  // namespace roundpipe::testing

// What the automatic plan measures on real calls (simulated devices): what a
// layer keeps for its backward and what its backward holds beyond that, the
// measured times that replace parameter bytes, the upload rate, and the
// verbose log of the measured plan.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "roundpipe/planner.h"
#include "roundpipe/roundpipe.h"
#include "test_util.h"

namespace roundpipe {
namespace {

// What a layer keeps for its backward is measured on its forward with grad
// (its saved tensors and output), not only its output: a block whose hidden
// activations are 4 x wider than its output keeps them, and the automatic
// plan's estimate of its backward stage counts them.
struct WideBlockImpl : torch::nn::Cloneable<WideBlockImpl> {
  int64_t width, hidden;
  torch::nn::Linear up{nullptr}, down{nullptr};
  WideBlockImpl(int64_t w, int64_t h) : width(w), hidden(h) { reset(); }
  void reset() override {
    up = register_module("up", torch::nn::Linear(width, hidden));
    down = register_module("down", torch::nn::Linear(hidden, width));
  }
  at::Tensor forward(const at::Tensor& x) { return down(torch::relu(up(x))); }
};
TORCH_MODULE(WideBlock);

TEST(Planner, MeasuresWhatALayerKeepsForItsBackward) {
  torch::manual_seed(0);
  const int64_t rows = 64, width = 256, hidden = 1024;
  torch::nn::Sequential model(WideBlock(width, hidden));  // one layer
  RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1"));
  auto x = torch::randn({rows, width}), y = torch::randn({rows, width});
  for (int i = 0; i < 3; ++i)
    pipe.forward_backward(x, y, testing::mse_loss, false, RunConfig().set_num_microbatch(1));
  pipe.synchronize();
  // Whatever the plan, its backward stages cover every layer once, each
  // holding its parameters, their gradients (as many bytes) and what its
  // layers keep (stage grain), and their backward's working memory: these
  // calls of one microbatch measure the backwards that allocate the
  // gradients (Note [One microbatch a call]), which hold one gradient of
  // the layer's parameters on the way.
  const auto estimate = pipe.auto_plan(/*fused=*/true, 1, 0, /*memory_limit_gib=*/100.0);
  int64_t activations = 0, working_gradients = 0;
  for (const auto& s : estimate.stages) {
    if (!s.backward) continue;
    activations += s.memory_bytes - 2 * s.param_bytes;
    working_gradients += s.param_bytes;
  }
  // Kept at least: the ReLU's output (rows x hidden floats, also the second
  // linear's saved input) and the block's output (rows x width): 5 x the
  // output alone.
  EXPECT_GE(activations, rows * hidden * 4) << estimate.describe();
  EXPECT_LE(activations, 4 * (rows * hidden * 4 + rows * width * 4) + working_gradients)
      << estimate.describe();
}

// Verbose mode logs the plan on bytes first and again once timings are
// measured, with each layer's times and what it keeps for its backward, even
// when the plan itself stays the same (one layer: one stage).
TEST(Planner, VerboseLogsTheMeasuredPlanEvenWhenItStaysTheSame) {
  torch::manual_seed(0);
  torch::nn::Sequential model(WideBlock(64, 256));
  RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1").set_verbose(true));
  auto x = torch::randn({16, 64}), y = torch::randn({16, 64});
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 4; ++i)
    pipe.forward_backward(x, y, testing::mse_loss, false, RunConfig().set_num_microbatch(1));
  pipe.synchronize();
  const std::string log = ::testing::internal::GetCapturedStderr();
  const auto first = log.find("costs from parameter bytes");
  const auto measured = log.find("costs measured");
  ASSERT_NE(first, std::string::npos) << log;
  ASSERT_NE(measured, std::string::npos) << log;
  EXPECT_LT(first, measured) << log;
  EXPECT_NE(log.find("kept for backward", measured), std::string::npos) << log;
  // Logged once each: later calls with the same plan stay quiet.
  EXPECT_EQ(log.find("costs measured", measured + 1), std::string::npos) << log;
}

// A layer with few parameters and a slow forward: its bytes say "cheap", its
// measured time says otherwise. The sleep is a floor that a loaded machine
// cannot shrink (compute alone would stretch alike in every layer, and a
// plain layer preempted once can take milliseconds).
struct SlowLinearImpl : torch::nn::Cloneable<SlowLinearImpl> {
  torch::nn::Linear inner{nullptr};
  SlowLinearImpl() { reset(); }
  void reset() override { inner = register_module("inner", torch::nn::Linear(64, 64)); }
  at::Tensor forward(const at::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return inner(x);
  }
};
TORCH_MODULE(SlowLinear);

TEST(Planner, MeasuredTimesReplaceBytesAfterWarmUp) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < 6; ++l) {
    if (l == 3) {
      model->push_back(SlowLinear());
    } else {
      model->push_back(torch::nn::Linear(64, 64));
    }
  }
  RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:4"));
  auto by_bytes = pipe.auto_plan(/*fused=*/true, 5);
  auto x = torch::randn({10, 64}), y = torch::randn({10, 64});
  for (int i = 0; i < 3; ++i) pipe.forward_backward(x, y, testing::mse_loss);
  pipe.synchronize();
  auto measured = pipe.auto_plan(/*fused=*/true, 5);
  // Measured: the backward stage holding the slow layer dominates the
  // others (by bytes all layers cost alike): 20 ms against a plain
  // layer's microseconds of compute and runner overhead, which a loaded
  // machine stretches (10 x seen while a build ran beside it): 5 x.
  double slow = 0, others = 0;
  for (const auto& s : measured.stages) {
    if (!s.backward) continue;
    (s.range.begin <= 3 && 3 < s.range.end ? slow : others) =
        std::max(s.range.begin <= 3 && 3 < s.range.end ? slow : others, s.compute);
  }
  EXPECT_GT(slow, 5 * others) << measured.describe();
  EXPECT_NE(by_bytes.describe(), measured.describe());
  EXPECT_EQ(pipe.default_plan(true).to_string(), measured.plan.to_string());
  // Predicted times are now seconds: a few calls of this model take well under one.
  EXPECT_LT(measured.iteration, 5.0) << measured.describe();
  EXPECT_GT(measured.iteration, 0.0);
}

// Once it plans on measured times, the engine probes the host-to-device rate
// and the plan's stages carry their upload times: here a 20 MB/s link, so
// each 1 MiB layer takes about 50 ms to upload.
TEST(Planner, MeasuredPlansSeeTheUploadRate) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < 4; ++l) model->push_back(torch::nn::Linear(512, 512));
  RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:2,gbps=0.02"));
  for (const auto& s : pipe.auto_plan(/*fused=*/true, 3).stages) EXPECT_EQ(s.upload, 0);
  auto x = torch::randn({6, 512}), y = torch::randn({6, 512});
  for (int i = 0; i < 3; ++i) pipe.forward_backward(x, y, testing::mse_loss);
  pipe.synchronize();
  const auto measured = pipe.auto_plan(/*fused=*/true, 3);
  const double layer_bytes = (512.0 * 512 + 512) * 4;
  for (const auto& s : measured.stages) {
    const double expected = s.range.size() * layer_bytes / 0.02e9;
    EXPECT_GT(s.upload, 0.5 * expected) << measured.describe();
    EXPECT_LT(s.upload, 2.0 * expected) << measured.describe();
  }
}

// Note [Backward working memory]: a layer whose backward allocates a large
// temporary (a trainable projection's, 2 MiB where its output is 8 KiB a
// microbatch) is planned with it from the first measured plan: after one
// call of two microbatches, the tail stage that holds it counts the
// temporary. The first call's first microbatch allocates the gradient
// (unmetered), its second is metered and counts.
struct ScratchInBackward : torch::autograd::Function<ScratchInBackward> {
  static constexpr int64_t kScratchFloats = int64_t{1} << 19;  // 2 MiB
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return at::matmul(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto scratch = at::ones({kScratchFloats}, grads[0].options());
    const auto gx = at::matmul(grads[0], saved[1].t()) + scratch.narrow(0, 0, 1) * 0;
    return {gx, at::matmul(saved[0].t(), grads[0])};
  }
};
struct BackwardHeavyImpl : torch::nn::Cloneable<BackwardHeavyImpl> {
  at::Tensor weight;
  BackwardHeavyImpl() { reset(); }
  void reset() override { weight = register_parameter("weight", torch::randn({64, 64}) / 8); }
  at::Tensor forward(const at::Tensor& x) { return ScratchInBackward::apply(x, weight); }
};
TORCH_MODULE(BackwardHeavy);

TEST(Planner, TheFirstMeasuredPlanCountsWhatALayersBackwardHolds) {
  torch::manual_seed(0);
  torch::nn::Sequential model(BackwardHeavy{});
  RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1"));
  auto x = torch::randn({64, 64}), y = torch::randn({64, 64});
  pipe.forward_backward(x, y, testing::mse_loss, false, RunConfig().set_num_microbatch(2));
  pipe.synchronize();
  const auto estimate = pipe.auto_plan(/*fused=*/true, 2, 0, /*memory_limit_gib=*/100.0);
  ASSERT_EQ(estimate.stages.size(), 1u) << estimate.describe();
  EXPECT_GE(estimate.stages[0].memory_bytes, ScratchInBackward::kScratchFloats * 4)
      << estimate.describe();
}

}  // namespace
}  // namespace roundpipe

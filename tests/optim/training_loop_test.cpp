// Full training loops through RoundPipe::step against plain LibTorch:
// sync mode step for step, async mode against an explicit one-step-delay
// oracle; frozen parameters; step_fn errors.
#include <gtest/gtest.h>
#include <roundpipe/optim/adam.h>
#include <torch/nn/functional/loss.h>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

constexpr int kSteps = 4;
constexpr int64_t kBatch = 12;

at::Tensor mse(const c10::IValue& out, const c10::IValue& label) {
  return torch::nn::functional::mse_loss(out.toTensor(), label.toTensor());
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  return {make_input(ModelKind::kMlp, kBatch, 300 + step),
          at::randn({kBatch, 4}, at::detail::createCPUGenerator(400 + step))};
}

// The summed microbatch loss of the plain model on one device.
at::Tensor plain_loss(torch::nn::Sequential& model, const at::Tensor& x, const at::Tensor& y, int n,
                      c10::Device dev) {
  at::Tensor loss = at::zeros({}, dev);
  int64_t start = 0;
  for (int m = 0; m < n; ++m) {
    const int64_t rows = kBatch / n + (m < kBatch % n ? 1 : 0);
    loss = loss + mse(model->forward(x.to(dev).narrow(0, start, rows)), y.to(dev).narrow(0, start, rows));
    start += rows;
  }
  return loss;
}

optim::AdamConfig adam_config() { return optim::AdamConfig().set_lr(2e-2).set_weight_decay(0.01); }
torch::optim::AdamOptions torch_adam_options() {
  return torch::optim::AdamOptions(2e-2).weight_decay(0.01);
}

class OptimizerLoopTest : public ::testing::TestWithParam<std::string> {};

TEST_P(OptimizerLoopTest, SyncStepEqualsPlainTrainingStepForStep) {
  const c10::Device dev = oracle_device(GetParam());
  auto model = make_model(ModelKind::kMlp), ref = make_model(ModelKind::kMlp);
  ref->to(dev);
  RoundPipe pipe(model, RoundPipeOptions().set_devices(GetParam()));
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  torch::optim::Adam ref_adam(ref->parameters(), torch_adam_options());
  const int n = pipe.devices().size() + 1;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    auto loss = pipe.forward_backward(x, y, mse).loss;
    pipe.step([&] {
      adam.step();
      adam.zero_grad();
    }, /*is_async=*/false);
    auto ref_loss = plain_loss(ref, x, y, n, dev);
    ref_loss.backward();
    ref_adam.step();
    ref_adam.zero_grad();
    EXPECT_TENSOR_NEAR(loss, ref_loss, 1e-5, "loss at step " << step);
    // Sync: the model already holds this step's weights.
    auto p = model->parameters(), q = ref->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_TENSOR_NEAR(p[i], q[i], 1e-5, "weight " << i << " after step " << step);
    }
  }
}

TEST_P(OptimizerLoopTest, AsyncStepEqualsTheOneStepDelayOracle) {
  const c10::Device dev = oracle_device(GetParam());
  auto model = make_model(ModelKind::kMlp), ref = make_model(ModelKind::kMlp);
  ref->to(dev);
  RoundPipe pipe(model, RoundPipeOptions().set_devices(GetParam()));
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  // The oracle: masters M updated by Adam with the gradient taken at the
  // weights W; W for iteration k+1 is M before update k (W_0 = W_1 = M_0).
  std::vector<at::Tensor> masters;
  for (const auto& p : ref->parameters()) masters.push_back(p.detach().clone().requires_grad_(true));
  torch::optim::Adam ref_adam(masters, torch_adam_options());
  const int n = pipe.devices().size() + 1;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    auto loss = pipe.forward_backward(x, y, mse).loss;
    pipe.step([&] {
      adam.step();
      adam.zero_grad();
    });
    for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
    auto ref_loss = plain_loss(ref, x, y, n, dev);
    ref_loss.backward();
    std::vector<at::Tensor> before;
    auto params = ref->parameters();
    for (size_t i = 0; i < masters.size(); ++i) {
      before.push_back(masters[i].detach().clone());
      masters[i].mutable_grad() = params[i].grad().clone();
    }
    ref_adam.step();
    ref_adam.zero_grad();
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(before[i]);
    }
    EXPECT_TENSOR_NEAR(loss, ref_loss, 1e-5, "loss at step " << step);
  }
  pipe.synchronize();  // publishes the last update
  auto p = model->parameters();
  for (size_t i = 0; i < p.size(); ++i) {
    EXPECT_TENSOR_NEAR(p[i], masters[i], 1e-5, "weight " << i << " after synchronize");
  }
}

TEST_P(OptimizerLoopTest, FrozenParametersGetNoMasterAndStayFixed) {
  auto model = make_model(ModelKind::kMlp);
  auto params = model->parameters();
  params[0].requires_grad_(false);  // freeze the first weight (6x16)
  const auto frozen = params[0].clone();
  RoundPipe pipe(model, RoundPipeOptions().set_devices(GetParam()).set_optim_dtype(at::kDouble));
  auto named = pipe.optim_named_parameters();
  int64_t master_bytes = 0, trainable_elements = 0;
  for (const auto& [name, master] : named) {
    EXPECT_NE(name, "0.weight");
    EXPECT_EQ(master.scalar_type(), at::kDouble);
    master_bytes += master.nbytes();
  }
  for (const auto& p : params) trainable_elements += p.requires_grad() ? p.numel() : 0;
  EXPECT_EQ(named.size(), params.size() - 1);
  EXPECT_EQ(named[0].first, "0.bias");
  EXPECT_EQ(master_bytes, trainable_elements * 8);  // frozen weights cost no optimizer memory
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  for (int step = 0; step < 2; ++step) {
    auto [x, y] = batch(step);
    pipe.forward_backward(x, y, mse);
    pipe.step([&] {
      adam.step();
      adam.zero_grad();
    });
  }
  pipe.synchronize();
  EXPECT_TRUE(at::equal(params[0], frozen));
  EXPECT_FALSE(at::equal(params[2], make_model(ModelKind::kMlp)->parameters()[2]));
}

TEST_P(OptimizerLoopTest, StepFunctionErrorsReachTheCaller) {
  auto model = make_model(ModelKind::kMlp);
  RoundPipe pipe(model, RoundPipeOptions().set_devices(GetParam()));
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  auto [x, y] = batch(0);
  pipe.forward_backward(x, y, mse);
  EXPECT_THROW(pipe.step([] { throw std::runtime_error("bad step"); }, false), std::runtime_error);
  pipe.forward_backward(x, y, mse);
  pipe.step([] { throw std::runtime_error("bad async step"); });
  try {
    pipe.synchronize();
    FAIL() << "the async step's error was lost";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "bad async step");
  }
  // Still usable.
  pipe.forward_backward(x, y, mse);
  pipe.step([&] { adam.step(); adam.zero_grad(); }, false);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, OptimizerLoopTest, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

}  // namespace
}  // namespace roundpipe::testing

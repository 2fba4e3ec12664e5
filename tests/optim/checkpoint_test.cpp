// Checkpoints: resuming gives the same next losses as not stopping; a save
// interrupted between its renames still loads.
#include <gtest/gtest.h>
#include <roundpipe/checkpoint.h>
#include <torch/nn/functional/loss.h>

#include <unistd.h>

#include <filesystem>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

struct Trainer {
  torch::nn::Sequential model;
  std::unique_ptr<RoundPipe> pipe;
  std::unique_ptr<optim::Adam> adam;
  std::unique_ptr<optim::GradScaler> scaler;
  Trainer(uint64_t seed, const std::string& backend, RunConfig run_config = {},
          optim::AdamConfig adam_config = optim::AdamConfig().set_lr(1e-2).set_amsgrad(true))
      : model(make_model(ModelKind::kBatchNorm, seed)) {
    pipe = std::make_unique<RoundPipe>(
        model, RoundPipeOptions().set_devices(backend).set_model_run_config(run_config));
    adam = std::make_unique<optim::Adam>(pipe->optim_parameters(), adam_config);
    scaler = std::make_unique<optim::GradScaler>(optim::GradScalerOptions().set_growth_interval(2));
  }
  double train_step(int step) {
    auto x = make_input(ModelKind::kBatchNorm, 12, 500 + step);
    auto y = at::randn({12, 4}, at::detail::createCPUGenerator(600 + step));
    auto loss = pipe->forward_backward(x, y,
                                       [&](const c10::IValue& o, const c10::IValue& l) {
                                         return scaler->scale(mse_loss(o, l));
                                       })
                    .loss;
    pipe->step(*adam, /*is_async=*/true, scaler.get());  // the fused async path
    scaler->update();
    return loss.item<double>() / scaler->get_scale();
  }
};

class CheckpointTest : public ::testing::TestWithParam<std::string> {};

// A directory of this test process alone (ctest runs backends in parallel).
std::string test_dir(const std::string& what) {
  return (process_temp_dir() / what).string();
}

// Trains 3 steps, saves, trains 3 more; a trainer of other initial weights
// (all must come from the checkpoint) loads it and must take the same 3
// steps. `resumed` is that trainer (an out-parameter: the checks may return
// early).
void expect_resume_continues(const std::string& backend, const std::string& what,
                             const optim::AdamConfig& config, std::unique_ptr<Trainer>& resumed) {
  const auto dir = test_dir(what);
  std::filesystem::remove_all(dir);
  Trainer first(1, backend, {}, config);
  for (int step = 0; step < 3; ++step) first.train_step(step);
  save_checkpoint(dir, *first.pipe, first.adam.get(), first.scaler.get());
  std::vector<double> continued;
  for (int step = 3; step < 6; ++step) continued.push_back(first.train_step(step));

  resumed = std::make_unique<Trainer>(99, backend, RunConfig{}, config);
  load_checkpoint(dir, *resumed->pipe, resumed->adam.get(), resumed->scaler.get());
  for (int step = 3; step < 6; ++step) {
    EXPECT_NEAR(resumed->train_step(step), continued[step - 3],
                1e-6 * std::abs(continued[step - 3]))
        << "step " << step;
  }
  first.pipe->synchronize();
  resumed->pipe->synchronize();
  auto a = first.model->parameters(), b = resumed->model->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TENSOR_NEAR(b[i], a[i], 1e-6, "weight " << i);
  auto c = first.model->buffers(), d = resumed->model->buffers();
  for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(at::equal(c[i], d[i])) << "buffer " << i;
}

TEST_P(CheckpointTest, ResumingGivesTheSameNextLosses) {
  std::unique_ptr<Trainer> resumed;
  expect_resume_continues(GetParam(), "ckpt_resume",
                          optim::AdamConfig().set_lr(1e-2).set_amsgrad(true), resumed);
}

// 8-bit state (every parameter of the small model quantized:
// min_8bit_size 0) saves its codes and scales and resumes exactly; an
// optimizer of the other state format refuses the checkpoint.
TEST_P(CheckpointTest, EightBitStateResumesExactly) {
  const auto eight_bit = optim::AdamConfig().set_lr(1e-2).set_optim_bits(8).set_min_8bit_size(0);
  std::unique_ptr<Trainer> resumed;
  expect_resume_continues(GetParam(), "ckpt_8bit", eight_bit, resumed);
  ASSERT_TRUE(resumed);
  for (const auto& [key, state] : resumed->adam->state()) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*state);
    EXPECT_EQ(s.exp_avg().scalar_type(), at::kByte);
    EXPECT_NE(dynamic_cast<const optim::QuantizedAdamParamState*>(state.get()), nullptr);
  }
  Trainer float32(2, GetParam(), {}, optim::AdamConfig().set_lr(1e-2));
  const auto error = message_of([&] {
    load_checkpoint(test_dir("ckpt_8bit"), *float32.pipe, float32.adam.get(), float32.scaler.get());
  });
  EXPECT_HAS(error, "8-bit and this optimizer's 32-bit");
}

// A checkpoint is taken without publishing the pending async update
// (RoundPipe::wait_for_background_work): a run that saves after every step
// computes exactly what a run that never saves computes. With one plan
// fixed for both, the two do the same arithmetic in the same order.
TEST_P(CheckpointTest, SavingDoesNotChangeAnAsyncRun) {
  const auto dir = test_dir("ckpt_every_step");
  std::filesystem::remove_all(dir);
  const int layers = make_model(ModelKind::kBatchNorm, 1)->size();
  const auto fixed =
      RunConfig().set_execute_plan(ExecutePlan::one_layer_per_stage(layers, /*fused=*/true));
  Trainer saving(1, GetParam(), fixed), plain(1, GetParam(), fixed);
  for (int step = 0; step < 5; ++step) {
    const double a = saving.train_step(step);
    save_checkpoint(dir, *saving.pipe, saving.adam.get(), saving.scaler.get());
    const double b = plain.train_step(step);
    EXPECT_EQ(a, b) << "step " << step;
  }
  saving.pipe->synchronize();
  plain.pipe->synchronize();
  auto a = saving.model->parameters(), b = plain.model->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "weight " << i;
}

TEST_P(CheckpointTest, AnInterruptedSaveLeavesALoadableCheckpoint) {
  const auto dir = test_dir("ckpt_crash");
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir + ".previous");
  Trainer t(1, GetParam());
  t.train_step(0);
  save_checkpoint(dir, *t.pipe, t.adam.get(), t.scaler.get());
  const auto saved = t.model->parameters()[0].clone();
  // A crash between the renames of the next save: the old checkpoint sits
  // under .previous, a half-built temporary beside it.
  std::filesystem::rename(dir, dir + ".previous");
  std::filesystem::create_directories(dir + ".tmp-12345");
  Trainer other(7, GetParam());
  load_checkpoint(dir, *other.pipe, other.adam.get(), other.scaler.get());
  EXPECT_TRUE(at::equal(other.model->parameters()[0], saved));
  // The next save cleans up and replaces it.
  save_checkpoint(dir, *other.pipe, other.adam.get(), other.scaler.get());
  EXPECT_TRUE(std::filesystem::exists(dir + "/model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir + ".previous"));
}

TEST_P(CheckpointTest, LoadingIntoAnotherArchitectureNamesTheMismatch) {
  const auto dir = test_dir("ckpt_arch");
  Trainer t(1, GetParam());
  save_checkpoint(dir, *t.pipe, t.adam.get(), nullptr);
  auto model = make_model(ModelKind::kMlp);
  RoundPipe pipe(model, RoundPipeOptions().set_devices(GetParam()));
  try {
    load_checkpoint(dir, pipe, nullptr, nullptr);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("another architecture"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, CheckpointTest, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

}  // namespace
}  // namespace roundpipe::testing

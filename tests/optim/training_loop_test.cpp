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

std::pair<at::Tensor, at::Tensor> batch(int step) {
  return {make_input(ModelKind::kMlp, kBatch, 300 + step),
          at::randn({kBatch, 4}, at::detail::createCPUGenerator(400 + step))};
}

constexpr double kLr = 2e-2;
// eps kAdamEps: weights after Adam steps are compared (test_util.h).
optim::AdamConfig adam_config() {
  return optim::AdamConfig().set_lr(kLr).set_weight_decay(0.01).set_eps(kAdamEps);
}
torch::optim::AdamOptions torch_adam_options() {
  return torch::optim::AdamOptions(kLr).weight_decay(0.01).eps(kAdamEps);
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
    auto loss = pipe.forward_backward(x, y, mse_loss).loss;
    pipe.step(
        [&] {
          adam.step();
          adam.zero_grad();
        },
        /*is_async=*/false);
    auto ref_loss = plain_microbatch_loss(ref, x, y, n, dev);
    ref_loss.backward();
    ref_adam.step();
    ref_adam.zero_grad();
    EXPECT_TENSOR_NEAR(loss, ref_loss, 1e-5, "loss at step " << step);
    // Sync: the model already holds this step's weights.
    auto p = model->parameters(), q = ref->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      // Adam steps on gradients that differ by rounding: (step + 1) * kLr * kGradError / kAdamEps.
      EXPECT_TENSOR_ABS_NEAR(p[i], q[i], adam_weight_tolerance(step + 1, kLr),
                             "weight " << i << " after step " << step);
    }
  }
}

// Every pin mode: with off (and register where pinning fails) the
// uploads read pageable homes and the async step's staging copies through
// a staging ring.
const char* pin_name(PinMode pin) {
  return pin == PinMode::kAlloc ? "alloc" : pin == PinMode::kRegister ? "register" : "off";
}

class AsyncStepTest : public ::testing::TestWithParam<std::tuple<std::string, PinMode>> {};

TEST_P(AsyncStepTest, AsyncStepEqualsTheOneStepDelayOracle) {
  const auto& [backend, pin] = GetParam();
  const c10::Device dev = oracle_device(backend);
  auto model = make_model(ModelKind::kMlp), ref = make_model(ModelKind::kMlp);
  ref->to(dev);
  RoundPipe pipe(model, RoundPipeOptions().set_devices(backend).set_pin_model(pin));
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  // The oracle: masters M updated by Adam with the gradient taken at the
  // weights W; W for iteration k+1 is M before update k (W_0 = W_1 = M_0).
  std::vector<at::Tensor> masters;
  for (const auto& p : ref->parameters())
    masters.push_back(p.detach().clone().requires_grad_(true));
  torch::optim::Adam ref_adam(masters, torch_adam_options());
  const int n = pipe.devices().size() + 1;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    auto loss = pipe.forward_backward(x, y, mse_loss).loss;
    pipe.step([&] {
      adam.step();
      adam.zero_grad();
    });
    for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
    auto ref_loss = plain_microbatch_loss(ref, x, y, n, dev);
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
    // kSteps Adam steps on gradients that differ by rounding (test_util.h): 8e-4.
    EXPECT_TENSOR_ABS_NEAR(p[i], masters[i], adam_weight_tolerance(kSteps, kLr),
                           "weight " << i << " after synchronize");
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, AsyncStepTest,
                         ::testing::Combine(::testing::ValuesIn(backends()),
                                            ::testing::Values(PinMode::kAlloc, PinMode::kRegister,
                                                              PinMode::kOff)),
                         [](const auto& info) {
                           return backend_test_name(std::get<0>(info.param)) + "_" +
                                  pin_name(std::get<1>(info.param));
                         });

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
    pipe.forward_backward(x, y, mse_loss);
    pipe.step([&] {
      adam.step();
      adam.zero_grad();
    });
  }
  pipe.synchronize();
  EXPECT_TRUE(at::equal(params[0], frozen));
  EXPECT_FALSE(at::equal(params[2], make_model(ModelKind::kMlp)->parameters()[2]));
}

// Note [Gradient buffers kept across steps]: a step function sees each
// batch's gradient in the masters' .grad; set to None, the next step casts
// into the same buffer, unless the caller still holds it (its values stay);
// not set to None, the next gradient is added to it. No step updates the
// weights here, so every gradient is plain LibTorch's on the same weights.
TEST_P(OptimizerLoopTest, StepFunctionGradientsReuseTheirBufferUnlessHeld) {
  const c10::Device dev = oracle_device(GetParam());
  auto model = make_model(ModelKind::kMlp), ref = make_model(ModelKind::kMlp);
  ref->to(dev);
  RoundPipe pipe(model, RoundPipeOptions().set_devices(GetParam()));
  const auto masters = pipe.optim_parameters();
  const int n = pipe.devices().size() + 1;
  auto plain_grad = [&](int step) {
    auto [x, y] = batch(step);
    for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
    plain_microbatch_loss(ref, x, y, n, dev).backward();
    return ref->parameters()[0].grad().cpu();
  };
  // One call and a sync step; `in_step` sees master 0's .grad.
  auto run = [&](int step, bool set_to_none,
                 const std::function<void(const at::Tensor&)>& in_step) {
    auto [x, y] = batch(step);
    pipe.forward_backward(x, y, mse_loss);
    pipe.step(
        [&] {
          in_step(masters[0].grad());
          if (set_to_none)
            for (auto m : masters) m.mutable_grad() = at::Tensor();
        },
        /*is_async=*/false);
  };
  // Step 0's gradient memory, watched without holding it (a weak reference).
  c10::weak_intrusive_ptr<c10::StorageImpl> first{c10::intrusive_ptr<c10::StorageImpl>()};
  at::Tensor values;
  run(0, true, [&](const at::Tensor& g) { first = g.storage().getWeakStorageImpl(); });
  run(1, true, [&](const at::Tensor& g) {
    EXPECT_EQ(first.lock().get(), g.storage().unsafeGetStorageImpl()) << "step 0's memory, reused";
    values = g.clone();
  });
  EXPECT_TENSOR_NEAR(values, plain_grad(1), 1e-5, "gradient of batch 1");
  at::Tensor held;  // the caller keeps step 2's gradient
  run(2, true, [&](const at::Tensor& g) { held = g; });
  run(3, true, [&](const at::Tensor& g) {
    EXPECT_NE(g.data_ptr(), held.data_ptr()) << "held memory is not written again";
    values = g.clone();
  });
  EXPECT_TENSOR_NEAR(held, plain_grad(2), 1e-5, "the held gradient of batch 2");
  EXPECT_TENSOR_NEAR(values, plain_grad(3), 1e-5, "gradient of batch 3");
  run(4, false, [](const at::Tensor&) {});  // not set to None: the next one adds to it
  run(5, true, [&](const at::Tensor& g) { values = g.clone(); });
  EXPECT_TENSOR_NEAR(values, plain_grad(4) + plain_grad(5), 1e-5, "batches 4 and 5 summed");
}

TEST_P(OptimizerLoopTest, StepFunctionErrorsReachTheCaller) {
  auto model = make_model(ModelKind::kMlp);
  RoundPipe pipe(model, RoundPipeOptions().set_devices(GetParam()));
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  auto [x, y] = batch(0);
  pipe.forward_backward(x, y, mse_loss);
  EXPECT_THROW(pipe.step([] { throw std::runtime_error("bad step"); }, false), std::runtime_error);
  pipe.forward_backward(x, y, mse_loss);
  pipe.step([] { throw std::runtime_error("bad async step"); });
  try {
    pipe.synchronize();
    FAIL() << "the async step's error was lost";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "bad async step");
  }
  // Still usable.
  pipe.forward_backward(x, y, mse_loss);
  pipe.step(
      [&] {
        adam.step();
        adam.zero_grad();
      },
      false);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, OptimizerLoopTest, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

}  // namespace
}  // namespace roundpipe::testing

#include <roundpipe/optim/grad_scaler.h>
#include <torch/nn/utils/clip_grad.h>

namespace roundpipe::testing {
namespace {

class FusedStepTest : public ::testing::TestWithParam<std::string> {};

// Two copies of a bf16 model with fp32 masters, each in a RoundPipe with an
// Adam: one stepped through a step function, one through the fused path.
// One plan for both: automatic plans follow measured times, and two plans
// may sum the same gradients in another order (a replicated tail adds its
// replicas' sums), which is not what these tests compare.
struct GeneralAndFused {
  explicit GeneralAndFused(const std::string& devices)
      : general_model(bf16_model()),
        fused_model(bf16_model()),
        general(general_model, options(devices, general_model->size())),
        fused(fused_model, options(devices, fused_model->size())),
        general_adam(general.optim_parameters(), adam_config()),
        fused_adam(fused.optim_parameters(), adam_config()) {}
  static torch::nn::Sequential bf16_model() {
    auto model = make_model(ModelKind::kMlp);
    model->to(at::kBFloat16);
    return model;
  }
  static RoundPipeOptions options(const std::string& devices, size_t layers) {
    const auto plan = ExecutePlan::one_layer_per_stage(static_cast<int>(layers), /*fused=*/true);
    return RoundPipeOptions()
        .set_devices(devices)
        .set_optim_dtype(at::kFloat)
        .set_model_run_config(RunConfig().set_execute_plan(plan));
  }
  torch::nn::Sequential general_model, fused_model;
  RoundPipe general, fused;
  optim::Adam general_adam, fused_adam;
};

// step(adam) (one fused pass) against step([&] { adam.step(); ... }) on a
// bf16 model with fp32 masters: the same weights and masters, bit for bit,
// in sync and async mode. The learning rate changes every step (a
// schedule): set before step(adam) returns, it applies to that step's
// update even when the update runs later, after the next rate was set.
TEST_P(FusedStepTest, FusedPathEqualsTheGeneralPath) {
  for (bool is_async : {false, true}) {
    SCOPED_TRACE(is_async ? "async" : "sync");
    GeneralAndFused pipes(GetParam());
    auto& [general_model, fused_model, general, fused, general_adam, fused_adam] = pipes;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      x = x.to(at::kBFloat16);
      y = y.to(at::kBFloat16);
      auto l1 = general.forward_backward(x, y, mse_loss).loss;
      auto l2 = fused.forward_backward(x, y, mse_loss).loss;
      EXPECT_TRUE(at::equal(l1, l2)) << "loss at step " << step;
      const auto lr = [](int k) { return kLr * (1.0 + k) / kSteps; };
      general.step(
          [&general_adam, rate = lr(step)] {
            general_adam.set_lr(rate);  // (on the optimizer thread, in update order)
            general_adam.step();
            general_adam.zero_grad();
          },
          is_async);
      if (step == 0) fused_adam.set_lr(lr(0));
      fused.step(fused_adam, is_async);
      fused_adam.set_lr(lr(step + 1));  // at once: this step's update may not have run yet
    }
    general.synchronize();
    fused.synchronize();
    auto a = general_model->parameters(), b = fused_model->parameters();
    auto ma = general.optim_parameters(), mb = fused.optim_parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::equal(a[i], b[i])) << "weight " << i;
      EXPECT_TRUE(at::equal(ma[i], mb[i])) << "master " << i;
      EXPECT_EQ(a[i].scalar_type(), at::kBFloat16);
    }
  }
}

// step(adam, ..., &clip) against LibTorch's clip_grad_norm_ then
// adam.step() in a step function, on a bf16 model with fp32 masters: the
// recorded norms are clip_grad_norm_'s, and the weights are the same up to
// the rounding of the norm (a float32 reduction there, a double sum of
// float32 norms here: the coefficients may differ in their last bit).
TEST_P(FusedStepTest, ClippingEqualsClipGradNormThenAdam) {
  for (bool is_async : {false, true}) {
    SCOPED_TRACE(is_async ? "async" : "sync");
    GeneralAndFused pipes(GetParam());
    auto& [general_model, fused_model, general, fused, general_adam, fused_adam] = pipes;
    // Small enough that every step clips (checked below).
    constexpr double kMaxNorm = 0.05;
    optim::GradClipper clip(kMaxNorm);
    std::vector<double> expected_norms;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      x = x.to(at::kBFloat16);
      y = y.to(at::kBFloat16);
      general.forward_backward(x, y, mse_loss);
      fused.forward_backward(x, y, mse_loss);
      general.step(
          [&] {
            expected_norms.push_back(
                torch::nn::utils::clip_grad_norm_(general_adam.parameters(), kMaxNorm));
            general_adam.step();
            general_adam.zero_grad();
          },
          is_async);
      fused.step(fused_adam, is_async, nullptr, &clip);
    }
    general.synchronize();
    fused.synchronize();
    const auto norms = clip.norms();
    ASSERT_EQ(norms.size(), expected_norms.size());
    for (size_t k = 0; k < norms.size(); ++k) {
      EXPECT_NEAR(norms[k], expected_norms[k], 1e-5 * expected_norms[k]) << "norm of step " << k;
      EXPECT_GT(norms[k], kMaxNorm) << "step " << k << " did not clip: the test shows nothing";
    }
    // A coefficient one float32 ulp apart moves an Adam step by far less
    // than its size (lr): the moments' ratio changes by ~1e-7.
    auto ma = general.optim_parameters(), mb = fused.optim_parameters();
    for (size_t i = 0; i < ma.size(); ++i)
      EXPECT_TENSOR_ABS_NEAR(ma[i], mb[i], 1e-6, "master " << i);
  }
}

TEST(GradClip, CoefficientAndNormAreClipGradNorms) {
  std::vector<at::Tensor> grads = {at::randn({7, 5}, at::detail::createCPUGenerator(1)),
                                   at::randn({3}, at::detail::createCPUGenerator(2))};
  std::vector<at::Tensor> params;
  for (const auto& g : grads) {
    auto p = at::zeros_like(g).requires_grad_(true);
    p.mutable_grad() = g.clone();
    params.push_back(p);
  }
  const double norm = optim::global_grad_norm(grads);
  const double expected = torch::nn::utils::clip_grad_norm_(params, 0.5);
  EXPECT_NEAR(norm, expected, 1e-6 * expected);
  const double coefficient = optim::clip_coefficient(norm, 0.5);
  for (size_t i = 0; i < grads.size(); ++i)
    EXPECT_TENSOR_NEAR(grads[i] * static_cast<float>(coefficient), params[i].grad(), 1e-6,
                       "gradient " << i);
  // Every dtype of the vectorised sum, across chunks (2^16) and lane tails,
  // and a strided tensor (ATen's norm): the norm of their float values, to
  // the float rounding of a lane's 256 squares (adam_kernel.cpp: 7.5e-6).
  const auto big = at::randn({3 * (1 << 16) + 37}, at::detail::createCPUGenerator(3));
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const std::vector<at::Tensor> mixed = {big.to(dtype), grads[0].to(dtype).t(),
                                           grads[1].to(dtype)};
    double squares = 0;
    for (const auto& g : mixed) squares += g.to(at::kDouble).pow(2).sum().item<double>();
    EXPECT_NEAR(optim::global_grad_norm(mixed), std::sqrt(squares), 1e-5 * std::sqrt(squares))
        << dtype;
  }
  EXPECT_EQ(optim::clip_coefficient(0.1, 0.5), 1.0);  // under the limit: untouched
  EXPECT_EQ(optim::clip_coefficient(3.0, 0.0), 1.0);  // 0: measure only
  EXPECT_THROW(optim::GradClipper(-1.0), c10::Error);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, FusedStepTest, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

// GradScaler's unscale() (the clipping recipe): the step's step() does not
// unscale again; once per step. A synchronous update() applies the latest
// step's finding at once (the async one, the step before it).
TEST(GradScalerApi, UnscaleOnceThenStepAndASynchronousUpdate) {
  optim::GradScaler s(optim::GradScalerOptions().set_init_scale(8).set_growth_interval(100));
  auto g = at::full({2}, 16.0);
  EXPECT_TRUE(s.unscale({g}));
  EXPECT_TRUE(at::equal(g, at::full({2}, 2.0)));
  EXPECT_THROW(s.unscale({g}), c10::Error);
  bool ran = false;
  EXPECT_TRUE(s.step({g}, [&] { ran = true; }));
  EXPECT_TRUE(ran);
  EXPECT_TRUE(at::equal(g, at::full({2}, 2.0))) << "unscaled twice";
  s.update();
  EXPECT_EQ(s.get_scale(), 8.0);
  EXPECT_FALSE(s.step({at::full({1}, std::numeric_limits<double>::infinity())}, [] {}));
  s.update(std::nullopt, /*is_async=*/false);
  EXPECT_EQ(s.get_scale(), 4.0);
  s.update(2.0, /*is_async=*/false);  // a synchronous new scale: at once
  EXPECT_EQ(s.get_scale(), 2.0);
  s.update(3.0);  // async, as the original: from the next update() on
  EXPECT_EQ(s.get_scale(), 2.0);
  s.update();
  EXPECT_EQ(s.get_scale(), 3.0);
}

// GradScaler: an injected inf skips exactly that step, and the scale follows
// torch's GradScaler rules with the documented one-iteration lag.
class GradScalerTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(GradScalerTest, SkipsOverflowingStepsAndFollowsTheScaleRules) {
  const auto& [backend, is_async] = GetParam();
  const c10::Device dev = oracle_device(backend);
  const int steps = 7;
  const std::set<int> overflow = {2, 3};
  auto model = make_model(ModelKind::kMlp), ref = make_model(ModelKind::kMlp);
  ref->to(dev);
  RoundPipe pipe(model, RoundPipeOptions().set_devices(backend));
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  optim::GradScaler scaler(optim::GradScalerOptions().set_init_scale(1024).set_growth_interval(2));
  std::vector<double> used_scales;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    const bool inject = overflow.count(step) > 0;
    used_scales.push_back(scaler.get_scale());
    pipe.forward_backward(x, y, [&, inject](const c10::IValue& out, const c10::IValue& label) {
      auto loss = scaler.scale(mse_loss(out, label));
      return inject ? loss * std::numeric_limits<float>::infinity() : loss;
    });
    pipe.step(
        [&] {
          scaler.step(adam);
          adam.zero_grad();
        },
        is_async);
    scaler.update();
  }
  pipe.synchronize();
  // The expected trajectory: update u applies step u-1's finding.
  double scale = 1024;
  int tracker = 0;
  std::vector<double> expected = {scale};
  for (int u = 0; u + 1 < steps; ++u) {
    if (u >= 1) {
      if (overflow.count(u - 1)) {
        scale *= 0.5;
        tracker = 0;
      } else if (++tracker == 2) {
        scale *= 2;
        tracker = 0;
      }
    }
    expected.push_back(scale);
  }
  EXPECT_EQ(used_scales, expected);
  for (int step = 0; step < steps; ++step)
    EXPECT_EQ(scaler.found_inf(step), overflow.count(step) > 0);
  // The weights: plain training that skips the overflowing steps (with the
  // async one-step delay where it applies).
  std::vector<at::Tensor> masters;
  for (const auto& p : ref->parameters())
    masters.push_back(p.detach().clone().requires_grad_(true));
  torch::optim::Adam ref_adam(masters, torch_adam_options());
  const int n = pipe.devices().size() + 1;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    auto params = ref->parameters();
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    plain_microbatch_loss(ref, x, y, n, dev).backward();
    std::vector<at::Tensor> before;
    for (size_t i = 0; i < masters.size(); ++i) {
      before.push_back(masters[i].detach().clone());
      masters[i].mutable_grad() = params[i].grad().clone();
    }
    if (!overflow.count(step)) ref_adam.step();
    ref_adam.zero_grad();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(is_async ? before[i] : masters[i]);
  }
  auto p = model->parameters();
  // The Adam steps taken (the overflowing ones skipped) on gradients that differ by rounding.
  const double tol = adam_weight_tolerance(steps - static_cast<int>(overflow.size()), kLr);
  for (size_t i = 0; i < p.size(); ++i)
    EXPECT_TENSOR_ABS_NEAR(p[i], masters[i], tol, "weight " << i);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, GradScalerTest,
                         ::testing::Combine(::testing::ValuesIn(backends()), ::testing::Bool()),
                         [](const auto& info) {
                           return backend_test_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_async" : "_sync");
                         });

}  // namespace
}  // namespace roundpipe::testing

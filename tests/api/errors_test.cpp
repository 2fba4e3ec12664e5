// Errors a user or a layer can cause: each gives a clear message, and the
// RoundPipe stays usable for the next call. On every backend.
#include <roundpipe/optim/adam.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

std::atomic<int> fail_at_microbatch{-1};  // -1: never
std::atomic<bool> fail_in_recompute{false};

// Throws in its forward for one microbatch (counted per call) when asked.
struct FlakyImpl : torch::nn::Cloneable<FlakyImpl> {
  torch::nn::Linear inner{nullptr};
  FlakyImpl() { reset(); }
  void reset() override { inner = register_module("inner", torch::nn::Linear(6, 6)); }
  at::Tensor forward(at::Tensor x) {
    if (doing_recompute() && fail_in_recompute)
      throw std::runtime_error("injected recompute failure");
    if (!doing_recompute() && fail_at_microbatch >= 0 && x.size(0) == 1 &&
        fail_at_microbatch-- == 0) {
      throw std::runtime_error("injected failure");
    }
    return inner(x);
  }
};
TORCH_MODULE(Flaky);

// Returns its output on the wrong device.
struct WrongDeviceImpl : torch::nn::Cloneable<WrongDeviceImpl> {
  void reset() override {}
  at::Tensor forward(at::Tensor x) { return x.to(at::kMeta); }
};
TORCH_MODULE(WrongDevice);

class ErrorsTest : public ::testing::TestWithParam<std::string> {
 protected:
  torch::nn::Sequential model() {
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(6, 6), torch::nn::Tanh(), Flaky(),
                                 torch::nn::Linear(6, 2));
  }
  LossFn mse = mse_loss;
};

TEST_P(ErrorsTest, WorkerExceptionReachesCallerWithContextThenNextCallWorks) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()).set_name("flaky"));
  auto config = RunConfig().set_num_microbatch(4).set_execute_plan(
      ExecutePlan::one_layer_per_stage(4, false));
  auto x = at::randn({4, 6});
  fail_at_microbatch = 2;  // microbatch index 2 of the Flaky layer (rows of 1)
  try {
    torch::NoGradGuard no_grad;
    pipe.forward(x, config);
    FAIL() << "expected a StageError";
  } catch (const StageError& e) {
    const std::string what = e.what();
    EXPECT_HAS(what, "flaky: forward stage 2 (layers 2..2)");
    EXPECT_HAS(what, "layer 2");
    EXPECT_HAS(what, "microbatch 2");
    EXPECT_HAS(what, "phase forward");
    EXPECT_HAS(what, "injected failure");
    EXPECT_EQ(e.layer, 2);
    EXPECT_EQ(e.microbatch, 2);
    EXPECT_EQ(e.phase, "forward");
    EXPECT_FALSE(e.out_of_memory);
  }
  fail_at_microbatch = -1;
  torch::NoGradGuard no_grad;
  auto out = pipe.forward(x, config);
  auto ref = m->forward(x);
  EXPECT_TENSOR_NEAR(out, ref, 1e-5, "call after the failure");
}

TEST_P(ErrorsTest, RecomputeFailureInBackgroundBackwardIsReported) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()).set_name("flaky"));
  auto config =
      RunConfig().set_num_microbatch(2).set_execute_plan(ExecutePlan::one_layer_per_stage(4, true));
  auto x = at::randn({4, 6}), y = at::randn({4, 2});
  fail_in_recompute = true;
  // The loss is known before the recompute of layer 2 runs, so the failure
  // surfaces at the next fence: synchronize().
  std::string what = message_of([&] {
    pipe.forward_backward(x, y, mse, false, config);
    pipe.synchronize();
  });
  fail_in_recompute = false;
  EXPECT_HAS(what, "backward stage");
  EXPECT_HAS(what, "phase recompute");
  EXPECT_HAS(what, "injected recompute failure");
  // The failed call left no gradients behind, and the next call trains
  // exactly like a fresh RoundPipe.
  pipe.synchronize();
  for (auto& p : pipe.parameters()) EXPECT_FALSE(p.grad().defined());
  auto loss = pipe.forward_backward(x, y, mse, false, config).loss;
  pipe.synchronize();
  auto fresh_model = model();
  RoundPipe fresh(fresh_model, RoundPipeOptions().set_devices(GetParam()));
  auto fresh_loss = fresh.forward_backward(x, y, mse, false, config).loss;
  fresh.synchronize();
  EXPECT_TENSOR_NEAR(loss, fresh_loss, 1e-6, "loss");
  for (size_t i = 0; i < pipe.parameters().size(); ++i) {
    EXPECT_TENSOR_NEAR(pipe.parameters()[i].grad(), fresh.parameters()[i].grad(), 1e-6,
                       "gradient " << i);
  }
}

// A step over a call that failed in the background reports the failure and
// updates nothing; the calls after it train as on a fresh RoundPipe (the
// step's weight version was once never published, and the next call's
// uploads waited for it forever).
TEST_P(ErrorsTest, AStepOverABackgroundFailureReportsItAndTheNextCallsTrain) {
  auto config =
      RunConfig().set_num_microbatch(2).set_execute_plan(ExecutePlan::one_layer_per_stage(4, true));
  const auto x = at::randn({4, 6}), y = at::randn({4, 2});
  for (bool is_async : {false, true}) {
    SCOPED_TRACE(is_async ? "async step" : "sync step");
    auto m = model();
    RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()).set_name("flaky"));
    int updates = 0;
    fail_in_recompute = true;
    const std::string what = message_of([&] {
      pipe.forward_backward(x, y, mse, false, config);
      pipe.step([&] { ++updates; }, is_async);
      pipe.synchronize();
    });
    fail_in_recompute = false;
    EXPECT_HAS(what, "injected recompute failure");
    EXPECT_EQ(updates, 0);
    const auto loss = pipe.forward_backward(x, y, mse, false, config).loss;
    pipe.step([&] { ++updates; }, is_async);
    pipe.synchronize();
    EXPECT_EQ(updates, 1);
    auto fresh_model = model();
    RoundPipe fresh(fresh_model, RoundPipeOptions().set_devices(GetParam()));
    const auto fresh_loss = fresh.forward_backward(x, y, mse, false, config).loss;
    fresh.synchronize();
    EXPECT_TENSOR_NEAR(loss, fresh_loss, 1e-6, "loss after the failed step");
  }
}

TEST_P(ErrorsTest, LossFunctionErrorsNameThePhase) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  auto x = at::randn({4, 6});
  auto what = message_of([&] {
    pipe.forward_backward(x, at::randn({4, 3}), mse);  // wrong label width
  });
  EXPECT_HAS(what, "phase loss");
  auto bad_loss = [](const c10::IValue& o, const c10::IValue&) { return o.toTensor(); };
  what = message_of([&] { pipe.forward_backward(x, at::randn({4, 2}), bad_loss); });
  EXPECT_HAS(what, "single-element loss");
  EXPECT_TRUE(pipe.forward_backward(x, at::randn({4, 2}), mse).loss.defined());
}

TEST_P(ErrorsTest, InputsMustBeOnTheCpu) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  auto what = message_of([&] { pipe.forward(at::randn({4, 6}).to(at::kMeta)); });
  EXPECT_HAS(what, "must be CPU tensors");
  EXPECT_HAS(what, ".cpu()");
}

// As the original's splitter (torch's pipelining): a batch of fewer rows
// than num_microbatch runs as one microbatch per row, so one long sequence
// trains with the default num_microbatch on several devices.
TEST_P(ErrorsTest, ABatchOfFewerRowsThanMicrobatchesIsOneMicrobatchARow) {
  auto m = model(), oracle = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  const auto x = at::randn({2, 6}, at::detail::createCPUGenerator(4));
  const auto y = at::randn({2, 2}, at::detail::createCPUGenerator(5));
  const auto result = pipe.forward_backward(x, y, mse, false, RunConfig().set_num_microbatch(5));
  pipe.synchronize();
  const auto expected = plain_microbatch_loss(oracle, x, y, 2, c10::Device(c10::kCPU));
  expected.backward();
  EXPECT_TENSOR_NEAR(result.loss, expected, 1e-5, "loss of 2 microbatches of a row");
  auto p = m->parameters(), q = oracle->parameters();
  for (size_t i = 0; i < p.size(); ++i)
    EXPECT_TENSOR_NEAR(p[i].grad(), q[i].grad(), 1e-5, "gradient " << i);
}

TEST_P(ErrorsTest, UnsplittableBatch) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  auto what = message_of([&] {
    pipe.forward(at::randn({4, 6}), RunConfig()
                                        .set_split_input([](const c10::IValue& v, int) {
                                          return std::vector<c10::IValue>{v};
                                        })
                                        .set_num_microbatch(2));
  });
  EXPECT_HAS(what, "split_input returned 1 microbatches, expected num_microbatch = 2");
}

TEST_P(ErrorsTest, WrongPlan) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  auto what = message_of([&] {
    pipe.forward(at::randn({4, 6}), RunConfig().set_execute_plan(ExecutePlan({{0, 3}}, {{0, 4}})));
  });
  EXPECT_HAS(what, "must end at layer 4");
}

TEST_P(ErrorsTest, LayerReturningATensorOnTheWrongDevice) {
  torch::nn::Sequential m(torch::nn::Linear(6, 6), WrongDevice(), torch::nn::Linear(6, 2));
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  torch::NoGradGuard no_grad;
  auto what = message_of([&] { pipe.forward(at::randn({4, 6})); });
  EXPECT_HAS(what, "layer 1");
  EXPECT_HAS(what, "returned a tensor on meta");
  EXPECT_HAS(what, "take their device from its inputs or weights");
}

// forward() + loss.backward(): a backward failure is thrown by backward()
// and not again by the next synchronize(); the call leaves no gradients.
TEST_P(ErrorsTest, BackwardErrorThroughAutogradIsReportedOnce) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  auto x = at::randn({4, 6}), y = at::randn({4, 2});
  auto config = RunConfig().set_num_microbatch(2).set_execute_plan(
      ExecutePlan::one_layer_per_stage(4, false));
  fail_in_recompute = true;
  auto loss = mse_loss(pipe.forward(x, config), y);
  const auto what = message_of([&] { loss.backward(); });
  fail_in_recompute = false;
  EXPECT_HAS(what, "injected recompute failure");
  EXPECT_EQ(message_of([&] { pipe.synchronize(); }), "(no error)");
  for (auto& p : pipe.parameters()) EXPECT_FALSE(p.grad().defined());
  auto again = mse_loss(pipe.forward(x, config), y);
  again.backward();
  pipe.synchronize();
  for (auto& p : pipe.parameters()) EXPECT_TRUE(p.grad().defined());
}

// Note [Calls from engine threads]: a step or loss function that calls its
// own RoundPipe's blocking methods gets an error, not a deadlock.
TEST_P(ErrorsTest, BlockingCallsFromInsideTheRoundPipeAreRefused) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  auto x = at::randn({4, 6}), y = at::randn({4, 2});
  pipe.forward_backward(x, y, mse);
  EXPECT_HAS(message_of([&] { pipe.step([&] { pipe.synchronize(); }, /*is_async=*/false); }),
             "synchronize() was called from inside this RoundPipe");
  pipe.forward_backward(x, y, mse);
  EXPECT_HAS(
      message_of([&] { pipe.step([&] { pipe.forward_backward(x, y, mse); }, /*is_async=*/false); }),
      "forward_backward() was called from inside this RoundPipe");
  pipe.forward_backward(x, y, mse);
  pipe.step([&] { pipe.step([] {}, false); }, /*is_async=*/true);
  EXPECT_HAS(message_of([&] { pipe.synchronize(); }), "step() was called from inside");
  const auto in_loss = message_of([&] {
    pipe.forward_backward(x, y, [&](const c10::IValue& o, const c10::IValue& l) {
      pipe.synchronize();
      return mse_loss(o, l);
    });
    pipe.synchronize();
  });
  EXPECT_HAS(in_loss, "phase loss");
  EXPECT_HAS(in_loss, "synchronize() was called from inside this RoundPipe");
  // Still usable.
  pipe.forward_backward(x, y, mse);
  pipe.step([] {}, false);
  pipe.synchronize();
}

// Destroying a RoundPipe finishes its work: an async step's update reaches
// the model as if synchronize() had been called.
TEST_P(ErrorsTest, DestroyingPublishesAPendingAsyncStep) {
  auto x = at::randn({4, 6}), y = at::randn({4, 2});
  auto train_once = [&](torch::nn::Sequential& m, bool synchronize) {
    // One fixed plan: both runs do the same arithmetic in the same order.
    auto pipe = std::make_unique<RoundPipe>(
        m, RoundPipeOptions()
               .set_devices(GetParam())
               .set_model_run_config(RunConfig().set_execute_plan(
                   ExecutePlan::one_layer_per_stage(4, /*fused=*/true))));
    optim::Adam adam(pipe->optim_parameters(), optim::AdamConfig().set_lr(0.1));
    pipe->forward_backward(x, y, mse);
    pipe->step(adam, /*is_async=*/true);
    if (synchronize) pipe->synchronize();
    pipe.reset();  // before the Adam it uses goes
  };
  auto dropped = model(), synchronized = model(), untouched = model();
  train_once(dropped, false);
  train_once(synchronized, true);
  const auto a = dropped->parameters(), b = synchronized->parameters(), c = untouched->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
    EXPECT_FALSE(at::equal(a[i], c[i])) << "parameter " << i << " was not updated";
  }
}

TEST_P(ErrorsTest, BackwardTwiceThroughTheSameOutputs) {
  auto m = model();
  RoundPipe pipe(m, RoundPipeOptions().set_devices(GetParam()));
  auto out = pipe.forward(at::randn({4, 6}));
  auto loss = out.sum();
  loss.backward({}, /*retain_graph=*/true);
  auto what = message_of([&] { loss.backward(); });
  EXPECT_HAS(what, "backward ran twice");
}

INSTANTIATE_TEST_SUITE_P(AllBackends, ErrorsTest, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

TEST(Errors, SimulatedOutOfMemoryThenASmallerPlanFits) {
  torch::manual_seed(0);
  // Four 64x64 fp32 linears: 16.6 KB each; the budget fits two stages of
  // one and a forward's compute (a few KB, charged too: Note [Simulated
  // device memory]), not four layers.
  torch::nn::Sequential m(torch::nn::Linear(64, 64), torch::nn::Linear(64, 64),
                          torch::nn::Linear(64, 64), torch::nn::Linear(64, 64));
  RoundPipe pipe(m, RoundPipeOptions().set_devices("sim:2,mem=48KiB"));
  auto x = at::randn({4, 64});
  torch::NoGradGuard no_grad;
  try {
    pipe.forward(x, RunConfig().set_execute_plan(ExecutePlan::single_stage(4, false)));
    FAIL() << "expected out of memory";
  } catch (const StageError& e) {
    EXPECT_TRUE(e.out_of_memory);
    EXPECT_EQ(e.phase, "parameter upload");
    EXPECT_HAS(std::string(e.what()), "out of memory");
  }
  auto out =
      pipe.forward(x, RunConfig().set_execute_plan(ExecutePlan::one_layer_per_stage(4, false)));
  EXPECT_TENSOR_NEAR(out, m->forward(x), 1e-5, "after the out-of-memory error");
}

// Note [Upload out of memory]: a stage's parameters that find no room
// while the stage before it still runs are uploaded again once it has
// left the device. One device fits one stage of two 64x64 linears (33 KB
// and its compute), not two; the first stage holds the device for 1 s (a
// slow last layer, long enough for a starved uploader thread), so the second
// stage's upload, which the uploader starts at once, runs out of memory; the forward still gives
// plain LibTorch's output, and the retry is counted. Before the retry the call failed with phase
// "parameter upload" (SimulatedOutOfMemoryThenASmallerPlanFits).
struct SlowImpl : torch::nn::Cloneable<SlowImpl> {
  void reset() override {}
  at::Tensor forward(const at::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    return x;
  }
};
TORCH_MODULE(Slow);

TEST(Errors, AnUploadThatFindsNoRoomWaitsForTheStageBefore) {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(64, 64), torch::nn::Linear(64, 64), Slow(),
                          torch::nn::Linear(64, 64), torch::nn::Linear(64, 64));
  RoundPipe pipe(m, RoundPipeOptions().set_devices("sim:1,mem=48KiB"));
  const auto x = at::randn({4, 64});
  torch::NoGradGuard no_grad;
  const auto plan = ExecutePlan({{0, 3}, {3, 5}}, {{3, 5}, {0, 3}});
  auto out = pipe.forward(x, RunConfig().set_num_microbatch(1).set_execute_plan(plan));
  EXPECT_TENSOR_NEAR(out, m->forward(x), 1e-5, "forward after the retried upload");
  EXPECT_GE(pipe.pipeline_stats().upload_out_of_memory_retries, 1);
}

// The uploader runs ahead of the worker, but only so far: a stage's
// parameters arrive once the stage two before it has left the device. On
// one device whose memory fits two one-layer stages and not three, a
// per-layer plan trains (three Adam steps) like plain LibTorch, however
// the copies' timing falls (jitter).
TEST(Errors, AtMostTwoStagesResidentUnderATightBudget) {
  torch::manual_seed(0);
  auto make = [] {
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::Tanh(),
                                 torch::nn::Linear(64, 64), torch::nn::Tanh(),
                                 torch::nn::Linear(64, 64), torch::nn::Linear(64, 4));
  };
  auto model = make(), oracle = make();
  // 16.6 KB per linear: two resident fit in 64 KiB with one's gradient and
  // the compute (charged too: Note [Simulated device memory]), three with
  // a gradient do not.
  RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1,mem=64KiB,jitter_us=300"));
  const int L = pipe.num_layers();
  auto config = RunConfig().set_num_microbatch(2).set_execute_plan(
      ExecutePlan::one_layer_per_stage(L, /*fused=*/true));
  // eps kAdamEps: the weights after the steps are compared (test_util.h).
  optim::Adam adam(pipe.optim_parameters(), optim::AdamConfig().set_lr(1e-2).set_eps(kAdamEps));
  torch::optim::Adam adam_ref(oracle->parameters(), torch::optim::AdamOptions(1e-2).eps(kAdamEps));
  std::vector<at::Tensor> losses;
  std::vector<at::Tensor> xs, ys;
  for (int step = 0; step < 3; ++step) {
    xs.push_back(at::randn({8, 64}, at::detail::createCPUGenerator(10 + step)));
    ys.push_back(at::randn({8, 4}, at::detail::createCPUGenerator(20 + step)));
    losses.push_back(pipe.forward_backward(xs[step], ys[step], mse_loss, false, config).loss);
    pipe.step(adam, /*is_async=*/false);
  }
  pipe.synchronize();
  // Two stages' parameters, one stage's gradients and 8 KiB of compute
  // (activations, the autograd engine's buffers): three stages resident in
  // a backward would be 66.5 KB and fail.
  constexpr int64_t kLinear = (64 * 64 + 64) * 4;
  EXPECT_LE(pipe.devices().at(0)->memory_stats().peak_bytes, 3 * kLinear + 8 * 1024);
  for (int step = 0; step < 3; ++step) {
    auto loss = plain_microbatch_loss(oracle, xs[step], ys[step], 2, c10::Device(c10::kCPU));
    EXPECT_TENSOR_NEAR(losses[step], loss, 1e-5, "loss at step " << step);
    loss.backward();
    adam_ref.step();
    adam_ref.zero_grad();
  }
  auto p = model->parameters(), q = oracle->parameters();
  // Three Adam steps on gradients that differ by rounding (test_util.h): 3e-4.
  for (size_t i = 0; i < p.size(); ++i)
    EXPECT_TENSOR_ABS_NEAR(p[i], q[i], adam_weight_tolerance(3, 1e-2), "parameter " << i);
}

// A layer that replaces its buffer by a tensor of another shape: the
// commit of its buffers cannot land. The error comes with the layer and the
// call, and a later forward of that layer stops rather than read a buffer
// half written.
struct ReshapingBufferImpl : torch::nn::Cloneable<ReshapingBufferImpl> {
  at::Tensor seen;
  ReshapingBufferImpl() { reset(); }
  void reset() override { seen = register_buffer("seen", torch::zeros({1})); }
  at::Tensor forward(const at::Tensor& x) {
    if (is_training()) {
      torch::NoGradGuard no_grad;
      seen.set_(torch::zeros({seen.size(0) + 1}, seen.options()));
    }
    return x;
  }
};
TORCH_MODULE(ReshapingBuffer);

TEST(Errors, AFailedBufferCommitIsReportedAndStopsLaterForwardsOfItsLayer) {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(4, 4), ReshapingBuffer(), torch::nn::Linear(4, 2));
  // Stage grain on a plan of the caller's (the automatic plan runs a first
  // call in layer grain, Note [Automatic grain]): the wrong shape first
  // shows in the commit (in layer grain the tail's recompute, which
  // restores the buffers, meets it first).
  RoundPipe pipe(m, RoundPipeOptions().set_devices("sim:1").set_model_run_config(
                        RunConfig()
                            .set_recompute_grain(RecomputeGrain::kStage)
                            .set_execute_plan(ExecutePlan::single_stage(3, /*fused=*/true))));
  auto x = at::randn({4, 4});
  auto y = at::randn({4, 2});
  pipe.forward_backward(x, y, mse_loss);  // its commit fails in the background
  const auto what = message_of([&] { pipe.synchronize(); });
  EXPECT_HAS(what, "buffer commit of layers 1 (call 0) failed");
  EXPECT_HAS(what, "came back as");
  const auto next = message_of([&] { pipe.forward_backward(x, y, mse_loss); });
  EXPECT_HAS(next, "an earlier call's buffer commit failed");
  EXPECT_EQ(m->buffers()[0].numel(), 1) << "the home buffer was not written";
}

TEST(Errors, BadConstructionArguments) {
  EXPECT_HAS(message_of([] {
               RoundPipe(torch::nn::Sequential(), RoundPipeOptions().set_devices("sim:1"));
             }),
             "no layers");
  EXPECT_HAS(message_of([] { pin_mode_from_string("pinned"); }), "use alloc, register or off");
}

}  // namespace
}  // namespace roundpipe::testing

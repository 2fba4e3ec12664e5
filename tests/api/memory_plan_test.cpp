// The automatic plan under memory pressure, against plain LibTorch: a call
// that runs out of memory is redone or its microbatch retried with the
// results of one that never failed (Note [Out-of-memory redo]); the grain
// (Note [Automatic grain]) and the tail's layers with grad (Note [Tail
// grain]) follow the budget. The tail's row chunks: tail_row_chunks_test.cpp.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>

#include "api/oom_injection.h"
#include "api/oracle.h"

namespace roundpipe::testing {
namespace {

// (OomInjector: an out-of-memory error where tests/api/oom_injection.h says.)
struct OomInjectorImpl : torch::nn::Cloneable<OomInjectorImpl> {
  torch::nn::Linear inner{nullptr};
  OomInjectorImpl() { reset(); }
  void reset() override { inner = register_module("inner", torch::nn::Linear(12, 12)); }
  at::Tensor forward(const at::Tensor& x) {
    const auto when = inject_when.load();
    const bool with_grad = c10::GradMode::is_enabled();
    if ((when == InjectWhen::kForward || (when == InjectWhen::kWithGrad && with_grad)) &&
        take_injected_oom()) {
      throw_injected_oom();
    }
    auto y = inner(x);
    if (when == InjectWhen::kBackward && y.requires_grad()) {
      y.register_hook([](const at::Tensor& g) {
        if (take_injected_oom()) throw_injected_oom();
        return g;
      });
    }
    return y;
  }
};
TORCH_MODULE(OomInjector);

torch::nn::Sequential oom_model() {
  torch::manual_seed(3);
  namespace nn = torch::nn;
  return nn::Sequential(nn::Linear(nn::LinearOptions(6, 12).bias(false)),
                        nn::BatchNorm1d(nn::BatchNormOptions(12).eps(0.1)), nn::Dropout(0.3),
                        OomInjector(), nn::Tanh(), nn::Linear(12, 4));
}

class OutOfMemoryRedoTest : public ::testing::TestWithParam<std::string> {};

// Note [Out-of-memory redo], Note [Out-of-memory retry of a microbatch]: a
// call that runs out of memory (once, or twice in a row) in a forward stage,
// the fused tail or a background backward is redone or retried smaller, and
// its loss, gradients, random streams (dropout) and buffer updates
// (BatchNorm) are those of a call that never failed: plain LibTorch's.
TEST_P(OutOfMemoryRedoTest, TheRedoneCallMatchesACallThatNeverFailed) {
  const auto& backend = GetParam();
  const c10::Device dev = oracle_device(backend);
  struct Case {
    InjectWhen when;
    int ooms;
    std::optional<RecomputeGrain> grain;
    const char* what;
  };
  const std::vector<Case> cases = {
      {InjectWhen::kForward, 1, std::nullopt, "a forward stage, once"},
      {InjectWhen::kForward, 2, std::nullopt, "a forward stage, twice"},
      {InjectWhen::kWithGrad, 1, RecomputeGrain::kStage, "the tail or a recompute, stage grain"},
      {InjectWhen::kWithGrad, 1, RecomputeGrain::kLayer, "the tail or a recompute, layer grain"},
      {InjectWhen::kBackward, 1, RecomputeGrain::kStage, "a backward, stage grain"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << backend << ", " << c.what);
    auto model = oom_model();
    auto oracle = oom_model();
    oracle->to(dev);
    RoundPipe pipe(model, RoundPipeOptions().set_devices(backend));
    const int n = 2;
    const auto x = at::randn({8, 6}, at::detail::createCPUGenerator(11));
    const auto y = at::randn({8, 4}, at::detail::createCPUGenerator(12));
    RunConfig config;
    config.set_num_microbatch(n);
    if (c.grain) config.set_recompute_grain(*c.grain);
    torch::manual_seed(5);
    inject_when = c.when;
    injected_ooms = c.ooms;
    auto result = pipe.forward_backward(x, y, mse_loss, false, config);
    pipe.synchronize();
    EXPECT_EQ(injected_ooms.load(), 0) << "the injected errors were not all raised";
    injected_ooms = 0;

    torch::manual_seed(5);
    const auto outs = oracle_microbatches(oracle, x.to(dev), n, draw_call_seed(), dev);
    const auto ys = microbatches_of(y, n);
    at::Tensor loss = at::zeros({}, at::TensorOptions().device(dev));
    for (int m = 0; m < n; ++m) loss = loss + mse_loss(outs[m], ys[m].to(dev));
    loss.backward();
    EXPECT_TENSOR_NEAR(result.loss, loss, kTol, "loss");
    expect_same_state(model, oracle, /*grads=*/true);
  }
}

// The same for forward(): a training forward that runs out of memory is
// redone before its output returns; its backward (through autograd) retries
// a microbatch by layer.
TEST_P(OutOfMemoryRedoTest, ATrainingForwardAndItsBackwardRecoverToo) {
  const auto& backend = GetParam();
  const c10::Device dev = oracle_device(backend);
  for (auto when : {InjectWhen::kForward, InjectWhen::kWithGrad}) {
    SCOPED_TRACE(::testing::Message()
                 << backend << (when == InjectWhen::kForward ? ", forward" : ", recompute"));
    auto model = oom_model();
    auto oracle = oom_model();
    oracle->to(dev);
    RoundPipe pipe(model, RoundPipeOptions().set_devices(backend));
    const int n = 2;
    const auto x = at::randn({8, 6}, at::detail::createCPUGenerator(11));
    const auto w = at::randn({8, 4}, at::detail::createCPUGenerator(12));
    const auto config =
        RunConfig().set_num_microbatch(n).set_recompute_grain(RecomputeGrain::kStage);
    torch::manual_seed(5);
    inject_when = when;
    injected_ooms = 1;
    auto out = pipe.forward(x, config);
    (out * w).sum().backward();
    pipe.synchronize();
    EXPECT_EQ(injected_ooms.load(), 0) << "the injected error was not raised";
    injected_ooms = 0;

    torch::manual_seed(5);
    auto ref = at::cat(oracle_microbatches(oracle, x.to(dev), n, draw_call_seed(), dev), 0);
    (ref * w.to(dev)).sum().backward();
    EXPECT_TENSOR_NEAR(out, ref, kTol, "output");
    expect_same_state(model, oracle, /*grads=*/true);
  }
}

// A redone call lets go of what the failed one saved (stage inputs and
// downloads in the host arena) before it saves its own: the arena's peak
// for a call redone after a forward stage ran out of memory is that of a
// call that never failed (it held both: 101 GiB for a 32B model's call).
TEST(OutOfMemoryRedo, TheRedoDoesNotHoldTheFailedCallsActivations) {
  auto arena_peak = [](int ooms) {
    torch::manual_seed(3);
    namespace nn = torch::nn;
    auto model = nn::Sequential(nn::Linear(6, 12), nn::Tanh(), nn::Linear(12, 12), nn::Tanh(),
                                nn::Linear(12, 12), OomInjector(), nn::Tanh(), nn::Linear(12, 4));
    // A limit of a few layers' parameters: several forward stages.
    RoundPipe pipe(model, RoundPipeOptions().set_devices("sim").set_model_memory_limit_gib(
                              4000.0 / (1 << 30)));
    // Stage inputs of 4096 rows dwarf the weights; the forward stages
    // before the injector's save theirs before it fails.
    const auto x = at::randn({4096, 6}, at::detail::createCPUGenerator(11));
    const auto y = at::randn({4096, 4}, at::detail::createCPUGenerator(12));
    inject_when = InjectWhen::kForward;
    injected_ooms = ooms;
    pipe.forward_backward(
        x, y, mse_loss, false,
        RunConfig().set_num_microbatch(2).set_recompute_grain(RecomputeGrain::kLayer));
    pipe.synchronize();
    EXPECT_EQ(injected_ooms.load(), 0) << "the injected error was not raised";
    injected_ooms = 0;
    EXPECT_EQ(pipe.pipeline_stats().out_of_memory_recoveries, ooms);
    return pipe.host_memory_stats().arena.peak_allocated_bytes;
  };
  const int64_t clean = arena_peak(0);
  const int64_t redone = arena_peak(1);
  // (What the failed call saved: at least one stage input of 4096 x 12 floats.)
  ASSERT_GT(clean, 4096 * 12 * 4) << "the call saved no stage inputs in the arena";
  EXPECT_LE(redone, clean + 4096 * 12 * 4 / 4)
      << "the redone call held the failed call's saved activations";
}

// Simulated devices charge compute as a card does (Note [Simulated device
// memory]): over a grid of widths, budgets, grains and microbatch counts,
// training with the automatic plan never fails for memory (a plan that
// does is redone smaller) and gives plain LibTorch's losses and gradients.
TEST(AutomaticPlanUnderABudget, TrainsWithinTheBudgetOverAGrid) {
  const std::vector<int64_t> widths = {64, 160};
  const std::vector<std::optional<RecomputeGrain>> grains = {std::nullopt, RecomputeGrain::kStage,
                                                             RecomputeGrain::kLayer};
  for (int64_t width : widths) {
    // The largest layer's parameters; budgets of 8 and 24 of them (until
    // activations are measured the plan keeps half the limit for them, and
    // a one-layer backward stage holds three layers' bytes).
    const int64_t layer_bytes = (width * width + width) * 4;
    for (int64_t budget : {8 * layer_bytes, 24 * layer_bytes}) {
      for (const auto& grain : grains) {
        for (int n : {1, 3}) {
          SCOPED_TRACE(::testing::Message()
                       << "width " << width << ", budget " << budget << " bytes, grain "
                       << (grain ? (*grain == RecomputeGrain::kStage ? "stage" : "layer") : "auto")
                       << ", " << n << " microbatches");
          auto make = [&] {
            torch::manual_seed(9);
            namespace nn = torch::nn;
            return nn::Sequential(nn::Linear(8, width), nn::Tanh(), nn::Linear(width, width),
                                  nn::Tanh(), nn::Linear(width, width), nn::Tanh(),
                                  nn::Linear(width, 4));
          };
          auto model = make(), oracle = make();
          RoundPipe pipe(model,
                         RoundPipeOptions().set_devices("sim:2,mem=" + std::to_string(budget)));
          RunConfig config;
          config.set_num_microbatch(n);
          if (grain) config.set_recompute_grain(*grain);
          at::Tensor oracle_loss = at::zeros({});
          for (int call = 0; call < 3; ++call) {
            const auto x = at::randn({6, 8}, at::detail::createCPUGenerator(30 + call));
            const auto y = at::randn({6, 4}, at::detail::createCPUGenerator(40 + call));
            const auto loss = pipe.forward_backward(x, y, mse_loss, false, config).loss;
            const auto expected = plain_microbatch_loss(oracle, x, y, n, c10::Device(c10::kCPU));
            EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
            expected.backward();
          }
          pipe.synchronize();
          for (int d = 0; d < 2; ++d)
            EXPECT_LE(pipe.devices().at(d)->memory_stats().peak_bytes, budget);
          expect_same_state(model, oracle, /*grads=*/true);
        }
      }
    }
  }
}

// Note [Working memory that does not follow the rows]: a call of 64 times
// the rows after short ones trains, within the budget, with plain
// LibTorch's results. The short calls' backward working memory is mostly
// their parameters' gradients; scaled with the rows whole, it made every
// layer's estimate larger than the budget, and the longer call's plan
// failed with "model_memory_limit ... is too small" (the longer call peaks
// at under half the budget).
TEST(AutomaticPlanUnderABudget, ALongerCallAfterShortOnesTrainsWithinTheBudget) {
  for (int64_t width : {160, 256}) {
    SCOPED_TRACE(::testing::Message() << "width " << width);
    const int64_t budget = 24 * (width * width + width) * 4;  // 24 of its largest layers
    auto make = [&] {
      torch::manual_seed(9);
      namespace nn = torch::nn;
      return nn::Sequential(nn::Linear(8, width), nn::Tanh(), nn::Linear(width, width), nn::Tanh(),
                            nn::Linear(width, width), nn::Tanh(), nn::Linear(width, 4));
    };
    auto model = make(), oracle = make();
    RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1,mem=" + std::to_string(budget)));
    RunConfig config;
    config.set_num_microbatch(2);
    for (int call = 0; call < 5; ++call) {
      const int rows = call < 3 ? 6 : 384;
      const auto x = at::randn({rows, 8}, at::detail::createCPUGenerator(30 + call));
      const auto y = at::randn({rows, 4}, at::detail::createCPUGenerator(40 + call));
      at::Tensor loss;
      ASSERT_NO_THROW(loss = pipe.forward_backward(x, y, mse_loss, false, config).loss)
          << "call " << call << ", " << rows << " rows";
      const auto expected = plain_microbatch_loss(oracle, x, y, 2, c10::Device(c10::kCPU));
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
      expected.backward();
    }
    pipe.synchronize();
    EXPECT_EQ(pipe.pipeline_stats().out_of_memory_recoveries, 0);
    EXPECT_LE(pipe.devices().at(0)->memory_stats().peak_bytes, budget);
    expect_same_state(model, oracle, /*grads=*/true);
  }
}

// Each out-of-memory redo shrinks later plans (Note [Out-of-memory redo]);
// many in a row stop at one layer per stage, and the calls after them still
// run (they used to fail: the shrunk limit, or stage count, had no plan).
TEST(OutOfMemoryRedo, ManyShrinksStopAtOneLayerPerStage) {
  for (bool with_limit : {false, true}) {
    SCOPED_TRACE(with_limit ? "a model_memory_limit of 1 MiB" : "no memory limit");
    auto model = oom_model();
    auto oracle = oom_model();
    auto options = RoundPipeOptions().set_devices("sim:1");
    if (with_limit) options.set_model_memory_limit_gib(1.0 / 1024);
    RoundPipe pipe(model, options);
    const auto config = RunConfig().set_num_microbatch(2);
    inject_when = InjectWhen::kForward;
    // 5 redos a call (one fewer than fail a call), 0.75^40 of 1 MiB is
    // 10 bytes: far below one layer per stage.
    for (int call = 0; call < 9; ++call) {
      SCOPED_TRACE(::testing::Message() << "call " << call);
      injected_ooms = call < 8 ? 5 : 0;
      const auto x = at::randn({8, 6}, at::detail::createCPUGenerator(50 + call));
      const auto y = at::randn({8, 4}, at::detail::createCPUGenerator(60 + call));
      torch::manual_seed(5);
      at::Tensor loss;
      ASSERT_NO_THROW(loss = pipe.forward_backward(x, y, mse_loss, false, config).loss);
      pipe.synchronize();  // its backward's recomputes draw no more injected errors
      EXPECT_EQ(injected_ooms.load(), 0) << "the injected errors were not all raised";
      torch::manual_seed(5);
      const auto outs = oracle_microbatches(oracle, x, 2, draw_call_seed(), c10::Device(c10::kCPU));
      const auto ys = microbatches_of(y, 2);
      at::Tensor expected = at::zeros({});
      for (int m = 0; m < 2; ++m) expected = expected + mse_loss(outs[m], ys[m]);
      expected.backward();
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss");
    }
    injected_ooms = 0;
    pipe.synchronize();
    expect_same_state(model, oracle, /*grads=*/true);
  }
}

TEST(OutOfMemoryRedo, APlanOfTheCallersIsNotChangedAndTheErrorSaysOutOfMemory) {
  auto model = oom_model();
  RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1"));
  inject_when = InjectWhen::kForward;
  injected_ooms = 1;
  const auto config = RunConfig().set_num_microbatch(2).set_execute_plan(
      ExecutePlan::single_stage(pipe.num_layers(), /*fused=*/true));
  try {
    pipe.forward_backward(at::randn({4, 6}), at::randn({4, 4}), mse_loss, false, config);
    ADD_FAILURE() << "no error";
  } catch (const StageError& e) {
    EXPECT_TRUE(e.out_of_memory) << e.what();
    EXPECT_EQ(e.layer, 3) << e.what();
  }
  injected_ooms = 0;
  // The engine still works, and the failed call left nothing behind.
  EXPECT_NO_THROW(
      pipe.forward_backward(at::randn({4, 6}), at::randn({4, 4}), mse_loss, false, config));
  EXPECT_NO_THROW(pipe.synchronize());
}

// Counts the forwards that run with grad outside a recompute: in the fused
// tail, every layer's in stage grain, only the last one's in layer grain
// (the others run without grad, then are recomputed).
std::atomic<int> grad_forwards{0};
struct GradProbeImpl : torch::nn::Cloneable<GradProbeImpl> {
  torch::nn::Linear inner{nullptr};
  GradProbeImpl() { reset(); }
  void reset() override { inner = register_module("inner", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x) {
    if (c10::GradMode::is_enabled() && !doing_recompute()) ++grad_forwards;
    return inner(x);
  }
};
TORCH_MODULE(GradProbe);

// Note [Automatic grain]: without a grain of the caller's, calls run in
// layer grain until the layers' activations are measured, then in stage
// grain where it fits (a simulated device without a budget: always).
TEST(AutomaticGrain, LayerGrainUntilActivationsAreMeasuredThenStageGrainWhereItFits) {
  torch::manual_seed(0);
  torch::nn::Sequential m{GradProbe(), GradProbe(), GradProbe()};
  RoundPipe pipe(m, RoundPipeOptions().set_devices("sim:1"));
  const int n = 2;
  const auto x = at::randn({4, 4}), y = at::randn({4, 4});
  auto grad_forwards_of_one_call = [&](const RunConfig& config) {
    grad_forwards = 0;
    pipe.forward_backward(x, y, mse_loss, false, config);
    pipe.synchronize();
    return grad_forwards.load();
  };
  const auto config = RunConfig().set_num_microbatch(n);
  EXPECT_EQ(grad_forwards_of_one_call(config), n) << "the first call runs in layer grain";
  int last = 0;
  for (int call = 0; call < 4; ++call) last = grad_forwards_of_one_call(config);
  const auto plan = pipe.default_plan(true);
  ASSERT_GE(plan.backward.at(0).size(), 2) << plan.to_string();
  EXPECT_EQ(last, plan.backward.at(0).size() * n) << "measured: stage grain, " << plan.to_string();
  // A grain the caller sets is kept.
  const auto layer = RunConfig().set_num_microbatch(n).set_recompute_grain(RecomputeGrain::kLayer);
  EXPECT_EQ(grad_forwards_of_one_call(layer), n);
}

// A layer that keeps 16 x its output for its backward (a wide hidden
// activation), counting its forwards with grad outside a recompute.
struct WideProbeImpl : torch::nn::Cloneable<WideProbeImpl> {
  torch::nn::Linear up{nullptr}, down{nullptr};
  WideProbeImpl() { reset(); }
  void reset() override {
    up = register_module("up", torch::nn::Linear(4, 32));
    down = register_module("down", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (c10::GradMode::is_enabled() && !doing_recompute()) ++grad_forwards;
    return down(torch::tanh(up(x)));
  }
};
TORCH_MODULE(WideProbe);

// `layers` WideProbes, the same each time.
torch::nn::Sequential wide_probes(int layers) {
  torch::manual_seed(4);
  torch::nn::Sequential m;
  for (int l = 0; l < layers; ++l) m->push_back(WideProbe());
  return m;
}

// Note [Tail grain]: where the automatic plan runs in layer grain because
// stage grain does not fit, the fused tail still runs as many of its last
// layers with grad as the budget holds (more than one, fewer than all,
// somewhere between a small and a large budget), with plain LibTorch's
// losses and gradients.
TEST(TailGrain, TheTailRunsAsManyLayersWithGradAsTheBudgetHolds) {
  const int layers = 8, n = 2;
  const auto x = at::randn({1024, 4}, at::detail::createCPUGenerator(1));
  const auto y = at::randn({1024, 4}, at::detail::createCPUGenerator(2));
  std::vector<int> seen;
  for (int64_t budget_kib : {320, 448, 576, 704, 2048}) {
    SCOPED_TRACE(::testing::Message() << budget_kib << " KiB");
    auto model = wide_probes(layers), oracle = wide_probes(layers);
    // The plan gets 3/4 of the device: what it does not meter (transients
    // whose lifetime depends on the copy thread's timing, the likely cause
    // of one CI run's overflow by a microbatch's activation at 448 KiB)
    // varies, and once the fused tail's backward has left gradients of an
    // earlier microbatch an out-of-memory error there fails the call (Note
    // [Out-of-memory redo]).
    RoundPipe pipe(model, RoundPipeOptions()
                              .set_verbose(true)
                              .set_model_memory_limit_gib(budget_kib * 0.75 / (1 << 20))
                              .set_devices("sim:1,mem=" + std::to_string(budget_kib) + "KiB"));
    const auto config = RunConfig().set_num_microbatch(n);
    int last = 0;
    for (int call = 0; call < 5; ++call) {
      grad_forwards = 0;
      const auto loss = pipe.forward_backward(x, y, mse_loss, false, config).loss;
      pipe.synchronize();
      last = grad_forwards.load();
      const auto expected = plain_microbatch_loss(oracle, x, y, n, c10::Device(c10::kCPU));
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
      expected.backward();
    }
    expect_same_state(model, oracle, /*grads=*/true);
    EXPECT_LE(pipe.devices().at(0)->memory_stats().peak_bytes, budget_kib * 1024);
    seen.push_back(last / n);
  }
  EXPECT_TRUE(std::any_of(seen.begin(), seen.end(), [&](int k) { return k > 1 && k < layers; }))
      << "no budget ran part of the tail with grad: " << ::testing::PrintToString(seen);
}

// Note [Automatic grain]: a caller's "stage" grain (the original's
// benchmark/train.py passes it) runs its first call in layer grain, before
// the activations are measured, and later calls in stage grain on stages
// that fit: no budget runs out of memory, the results are plain
// LibTorch's, and some budget runs more than one tail layer with grad.
TEST(AutomaticGrain, ACallersStageGrainRunsOnStagesSizedFromMeasuredActivations) {
  const int layers = 8, n = 2;
  const auto x = at::randn({1024, 4}, at::detail::createCPUGenerator(1));
  const auto y = at::randn({1024, 4}, at::detail::createCPUGenerator(2));
  std::vector<int> seen;
  for (int64_t budget_kib : {448, 704, 2048}) {
    SCOPED_TRACE(::testing::Message() << budget_kib << " KiB");
    auto model = wide_probes(layers), oracle = wide_probes(layers);
    // (3/4 of the device to the plan, as in TailGrain above.)
    RoundPipe pipe(model, RoundPipeOptions()
                              .set_model_memory_limit_gib(budget_kib * 0.75 / (1 << 20))
                              .set_devices("sim:1,mem=" + std::to_string(budget_kib) + "KiB"));
    const auto config =
        RunConfig().set_num_microbatch(n).set_recompute_grain(RecomputeGrain::kStage);
    int last = 0;
    for (int call = 0; call < 4; ++call) {
      grad_forwards = 0;
      const auto loss = pipe.forward_backward(x, y, mse_loss, false, config).loss;
      pipe.synchronize();
      last = grad_forwards.load();
      if (call == 0) EXPECT_EQ(last, n) << "the first call runs in layer grain";
      const auto expected = plain_microbatch_loss(oracle, x, y, n, c10::Device(c10::kCPU));
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
      expected.backward();
    }
    expect_same_state(model, oracle, /*grads=*/true);
    EXPECT_EQ(pipe.pipeline_stats().out_of_memory_recoveries, 0);
    EXPECT_LE(pipe.devices().at(0)->memory_stats().peak_bytes, budget_kib * 1024);
    seen.push_back(last / n);
  }
  EXPECT_TRUE(std::any_of(seen.begin(), seen.end(), [](int k) { return k > 1; }))
      << "stage grain never ran: " << ::testing::PrintToString(seen);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, OutOfMemoryRedoTest, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

}  // namespace
}  // namespace roundpipe::testing

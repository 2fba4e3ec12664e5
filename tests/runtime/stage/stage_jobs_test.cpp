// The stage runner's parts, one job at a time (stage_fixture.h): a
// forward stage's hand-offs, a backward stage's gradients in stage and
// layer grain, the fused tail whole and in row chunks, the buffer commit
// and its snapshot, a microbatch retried by layer after running out of
// memory, and an error's place. Each against plain LibTorch autograd on a
// copy of the model with the same weights.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <set>

#include "runtime/stage/stage_fixture.h"
#include "test_util.h"

namespace roundpipe::testing {
namespace {

using detail::Slot;

// Layers [begin, end) of a Sequential of tensor-to-tensor modules.
at::Tensor run_layers(torch::nn::Sequential& model, int begin, int end, at::Tensor x) {
  auto it = model->begin() + begin;
  for (int l = begin; l < end; ++l, ++it) x = it->forward<at::Tensor>(x);
  return x;
}

std::map<std::string, at::Tensor> oracle_grads(torch::nn::Sequential& model) {
  std::map<std::string, at::Tensor> grads;
  for (const auto& p : model->named_parameters())
    if (p.value().grad().defined()) grads[p.key()] = p.value().grad();
  return grads;
}

void expect_same_grads(const std::map<std::string, at::Tensor>& ours,
                       const std::map<std::string, at::Tensor>& oracle) {
  ASSERT_EQ(ours.size(), oracle.size());
  for (const auto& [name, grad] : oracle) {
    ASSERT_TRUE(ours.count(name)) << name;
    EXPECT_TENSOR_NEAR(ours.at(name), grad, kGradError, name);
  }
}

// The MLP of the test matrix: 0 Linear, 1 Tanh, 2 Linear, 3 ReLU, 4 Linear.
constexpr int kLayers = 5;

TEST(StageJobs, ForwardStagesHandOnWhatTheirLayersCompute) {
  auto model = make_model(ModelKind::kMlp), oracle = make_model(ModelKind::kMlp);
  StageFixture f(model);
  const auto x = make_input(ModelKind::kMlp, 7, 3);
  auto call = f.call(x, 3, ExecutePlan({{0, 2}, {2, 5}}, {{2, 5}, {0, 2}}), false, false);
  f.run(call, JobKind::kForward, {0, 2});
  f.run(call, JobKind::kForward, {2, 5});
  ASSERT_FALSE(call->error.has_value()) << call->error->what();
  at::NoGradGuard no_grad;
  const auto xs = microbatches_of(x, 3);
  for (int m = 0; m < 3; ++m) {
    const auto h = run_layers(oracle, 0, 2, xs[m]);
    EXPECT_TENSOR_NEAR(f.value(call->act.at(2)[m]).toTensor(), h, 1e-6, "layer 2 input");
    EXPECT_TENSOR_NEAR(f.value(call->act.at(5)[m]).toTensor(), run_layers(oracle, 2, 5, h), 1e-6,
                       "output");
  }
}

// A training forward keeps the inputs where later backward stages (stage
// grain) or their layers (layer grain) start; a backward stage then gives
// autograd's input and parameter gradients for any output gradient.
// (Layer-from-stage grain with its rerun's inputs on the device or, as
// before activations are measured, on the host: Note [Thin checkpoints].)
struct GrainCase {
  RecomputeGrain grain;
  bool rerun_inputs_on_device = true;
};
class BackwardStage : public ::testing::TestWithParam<GrainCase> {};

TEST_P(BackwardStage, GivesAutogradsGradients) {
  auto model = make_model(ModelKind::kMlp), oracle = make_model(ModelKind::kMlp);
  StageFixture f(model);
  const int n = 3;
  const auto x = make_input(ModelKind::kMlp, 8, 4).requires_grad_(true);
  const auto grain = GetParam().grain;
  auto call = f.call(x, n, ExecutePlan({{0, 5}}, {{3, 5}, {0, 3}}), true, false, grain);
  call->rerun_inputs_on_device = GetParam().rerun_inputs_on_device;
  f.run(call, JobKind::kForward, {0, kLayers});
  // What the host keeps for the backward stages: every layer's input in
  // layer grain, else each backward stage's (Note [Thin checkpoints]).
  std::set<int> kept;
  for (const auto& [l, slots] : call->act) kept.insert(l);
  const std::set<int> expected =
      grain == RecomputeGrain::kLayer ? std::set<int>{0, 1, 2, 3, 4, 5} : std::set<int>{0, 3, 5};
  EXPECT_EQ(kept, expected);
  const auto xs = microbatches_of(x.detach(), n);
  std::vector<at::Tensor> out_grads;
  for (int m = 0; m < n; ++m) {
    out_grads.push_back(at::randn({xs[m].size(0), 4}, at::detail::createCPUGenerator(10 + m)));
    CallState::put(*call->grad.at(kLayers)[m], {}, {out_grads[m]}, nullptr, {});
  }
  f.run(call, JobKind::kBackward, {3, 5});
  std::vector<at::Tensor> grads_at_3;  // read before their last reader releases them
  for (int m = 0; m < n; ++m) grads_at_3.push_back(f.tensor(call->grad.at(3)[m]));
  f.run(call, JobKind::kBackward, {0, 3});
  ASSERT_FALSE(call->error.has_value()) << call->error->what();
  // (Note [Hand-offs end with their last reader]: every input kept for a
  // backward stage and every output gradient went back once read.)
  for (const auto& [l, slots] : call->act) {
    if (l == kLayers) continue;  // the forward's output: no backward stage reads it
    for (int m = 0; m < n; ++m) EXPECT_TRUE(slots[m]->released) << "input of layer " << l;
  }
  for (int m = 0; m < n; ++m) EXPECT_TRUE(call->grad.at(3)[m]->released);

  for (int m = 0; m < n; ++m) {
    auto xm = xs[m].clone().requires_grad_(true);
    auto h3 = run_layers(oracle, 0, 3, xm);
    h3.retain_grad();
    (run_layers(oracle, 3, 5, h3) * out_grads[m]).sum().backward();
    EXPECT_TENSOR_NEAR(grads_at_3[m], h3.grad(), kGradError, "gradient of layer 3's input");
    ASSERT_EQ(call->input_grads[m].size(), 1u);
    const at::Tensor input_grad = call->input_grads[m][0];
    EXPECT_TENSOR_NEAR(input_grad, xm.grad(), kGradError, "input gradient");
  }
  expect_same_grads(f.gradients(*call), oracle_grads(oracle));
}

INSTANTIATE_TEST_SUITE_P(Grains, BackwardStage,
                         ::testing::Values(GrainCase{RecomputeGrain::kStage},
                                           GrainCase{RecomputeGrain::kLayer},
                                           GrainCase{RecomputeGrain::kLayerFromStage, true},
                                           GrainCase{RecomputeGrain::kLayerFromStage, false}),
                         [](const auto& info) {
                           const bool thin = info.param.grain == RecomputeGrain::kLayerFromStage;
                           return std::string(to_string(info.param.grain)) +
                                  (thin && !info.param.rerun_inputs_on_device ? "_inputs_on_host"
                                                                              : "");
                         });

// A Linear whose input may be cut into chunks of rows (Note [Tail row
// chunks]): the fused tail may then run a microbatch chunk by chunk.
struct RowsLinearImpl : torch::nn::Cloneable<RowsLinearImpl>, SplitsInputRows {
  torch::nn::Linear linear{nullptr};
  RowsLinearImpl() { reset(); }
  void reset() override { linear = register_module("linear", torch::nn::Linear(16, 16)); }
  at::Tensor forward(at::Tensor x) { return linear(x); }
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    return split_tensor_rows(input, rows);
  }
};
TORCH_MODULE(RowsLinear);

torch::nn::Sequential rows_model() {
  torch::manual_seed(5);
  namespace nn = torch::nn;
  return nn::Sequential(nn::Linear(6, 16), nn::Tanh(), RowsLinear(), nn::Tanh(), nn::Linear(16, 4));
}

// A loss that adds up over rows, as a chunked tail needs.
at::Tensor sum_squared_error(const c10::IValue& out, const c10::IValue& label) {
  return (out.toTensor() - label.toTensor()).pow(2).sum() / 10.0;
}

struct TailCase {
  RecomputeGrain grain;
  int row_chunks;
};

class FusedTail : public ::testing::TestWithParam<TailCase> {};

// The tail's losses go out per microbatch (in chunks: added), the stage
// before gets autograd's gradient of the tail's input, and with the forward
// stage's backward all parameter gradients are autograd's.
TEST_P(FusedTail, RunsForwardLossAndBackward) {
  auto model = rows_model(), oracle = rows_model();
  StageFixture f(model);
  const int n = 2;
  const auto x = make_input(ModelKind::kMlp, 9, 6);
  const auto y = at::randn({9, 4}, at::detail::createCPUGenerator(7));
  auto call = f.call(x, n, ExecutePlan({{0, 2}}, {{2, 5}, {0, 2}}), true, true, GetParam().grain, y,
                     sum_squared_error);
  call->tail_row_chunks = GetParam().row_chunks;
  f.run(call, JobKind::kForward, {0, 2});
  f.run(call, JobKind::kTail, {2, 5});
  std::vector<at::Tensor> grads_at_2;  // read before their last reader releases them
  for (int m = 0; m < n; ++m) grads_at_2.push_back(f.tensor(call->grad.at(2)[m]));
  f.run(call, JobKind::kBackward, {0, 2});
  ASSERT_FALSE(call->error.has_value()) << call->error->what();
  if (GetParam().row_chunks > 1) EXPECT_EQ(f.stats.snapshot().tail_microbatches_in_row_chunks, n);

  const auto xs = microbatches_of(x, n), ys = microbatches_of(y, n);
  for (int m = 0; m < n; ++m) {
    auto h2 = run_layers(oracle, 0, 2, xs[m]);
    h2.retain_grad();
    const auto loss = sum_squared_error(run_layers(oracle, 2, 5, h2), ys[m]);
    loss.backward();
    EXPECT_TENSOR_NEAR(f.tensor(call->losses[m]), loss.detach(), 1e-6, "loss");
    EXPECT_TENSOR_NEAR(grads_at_2[m], h2.grad(), kGradError, "gradient of the tail's input");
  }
  expect_same_grads(f.gradients(*call), oracle_grads(oracle));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FusedTail,
    ::testing::Values(TailCase{RecomputeGrain::kStage, 1}, TailCase{RecomputeGrain::kLayer, 1},
                      TailCase{RecomputeGrain::kStage, 3}),
    [](const auto& info) {
      return std::string(info.param.grain == RecomputeGrain::kStage ? "stage" : "layer") +
             "_chunks" + std::to_string(info.param.row_chunks);
    });

// A forward stage commits its layers' buffer writes to their homes after
// its last microbatch, and snapshots the values it found for the call's
// backward stages (and a redo).
TEST(StageJobs, ForwardCommitsBufferWritesAndSnapshotsTheOldValues) {
  auto model = make_model(ModelKind::kBatchNorm), oracle = make_model(ModelKind::kBatchNorm);
  StageFixture f(model);
  const auto before = f.layers[1]->buffers().at(0).clone();  // BatchNorm's running mean
  const auto x = make_input(ModelKind::kBatchNorm, 9, 2);
  auto call = f.call(x, 3, ExecutePlan({{0, 6}}, {{0, 6}}), true, false);
  f.run(call, JobKind::kForward, {0, 6});
  ASSERT_FALSE(call->error.has_value()) << call->error->what();
  {
    at::NoGradGuard no_grad;
    for (const auto& xm : microbatches_of(x, 3)) oracle->forward(xm);
  }
  const auto oracle_buffers = oracle->buffers();
  const auto homes = f.layers[1]->buffers();
  ASSERT_FALSE(homes.at(0).equal(before)) << "the forward wrote no buffer";
  for (size_t i = 0; i < homes.size(); ++i)
    EXPECT_TENSOR_NEAR(homes[i].to(at::kFloat), oracle_buffers[i].to(at::kFloat), 1e-6,
                       "buffer " << i);
  EXPECT_TRUE(call->buffer_snapshot(1).at(0).equal(before));
}

// A layer that runs out of device memory in its first forward with grad
// (from `fail` on): the stage retries the microbatch by layer.
struct FailsOnceImpl : torch::nn::Cloneable<FailsOnceImpl> {
  std::shared_ptr<std::atomic<int>> fail = std::make_shared<std::atomic<int>>(0);
  void reset() override {}
  at::Tensor forward(at::Tensor x) {
    if (c10::GradMode::is_enabled() && fail->exchange(0) == 1)
      TORCH_CHECK_WITH(OutOfMemoryError, false, "simulated: the device ran out of memory");
    if (fail->load() == 2) TORCH_CHECK(false, "simulated layer failure");
    return x * 2;
  }
};
TORCH_MODULE(FailsOnce);

torch::nn::Sequential with_failing_layer(FailsOnce failing) {
  torch::manual_seed(8);
  namespace nn = torch::nn;
  return nn::Sequential(nn::Linear(6, 16), nn::Tanh(), failing, nn::Linear(16, 4));
}

// In stage grain all four layers run with grad; in layer-from-stage grain
// (its rerun's inputs on the device) the failing layer's first run with
// grad is its recompute, and the retry keeps the inputs on the host.
TEST(StageJobs, OutOfMemoryRetriesTheMicrobatchByLayerWithTheSameResult) {
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayerFromStage}) {
    SCOPED_TRACE(to_string(grain));
    FailsOnce failing;
    auto model = with_failing_layer(failing), oracle = with_failing_layer(FailsOnce());
    StageFixture f(model);
    const int n = 2;
    const auto x = make_input(ModelKind::kMlp, 6, 9);
    auto call = f.call(x, n, ExecutePlan({{0, 4}}, {{0, 4}}), true, false, grain);
    f.run(call, JobKind::kForward, {0, 4});
    std::vector<at::Tensor> out_grads;
    for (int m = 0; m < n; ++m) {
      out_grads.push_back(at::randn({3, 4}, at::detail::createCPUGenerator(20 + m)));
      CallState::put(*call->grad.at(4)[m], {}, {out_grads[m]}, nullptr, {});
    }
    *failing->fail = 1;  // the first run with grad of microbatch 0
    f.run(call, JobKind::kBackward, {0, 4});
    ASSERT_FALSE(call->error.has_value()) << call->error->what();
    EXPECT_EQ(*failing->fail, 0) << "the layer never ran with grad";
    EXPECT_EQ(f.out_of_memory_retries, 1);
    const auto xs = microbatches_of(x, n);
    for (int m = 0; m < n; ++m) (oracle->forward(xs[m]) * out_grads[m]).sum().backward();
    expect_same_grads(f.gradients(*call), oracle_grads(oracle));
  }
}

// An error fails the job's call with where it happened; the worker lives on.
TEST(StageJobs, AnErrorFailsTheCallWithItsPlace) {
  FailsOnce failing;
  StageFixture f(with_failing_layer(failing));
  *failing->fail = 2;
  const auto x = make_input(ModelKind::kMlp, 4, 1);
  auto call = f.call(x, 2, ExecutePlan({{0, 4}}, {{0, 4}}), false, false);
  f.run(call, JobKind::kForward, {0, 4});
  ASSERT_TRUE(call->error.has_value());
  EXPECT_EQ(call->error->layer, 2);
  EXPECT_EQ(call->error->microbatch, 0);
  EXPECT_EQ(call->error->phase, "forward");
  EXPECT_FALSE(call->error->out_of_memory);
  EXPECT_HAS(std::string(call->error->what()), "simulated layer failure");

  *failing->fail = 0;  // the next call runs on the same worker
  auto next = f.call(x, 2, ExecutePlan({{0, 4}}, {{0, 4}}), false, false);
  f.run(next, JobKind::kForward, {0, 4});
  EXPECT_FALSE(next->error.has_value());
}

}  // namespace
}  // namespace roundpipe::testing

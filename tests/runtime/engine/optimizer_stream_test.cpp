// The optimizer thread (runtime/engine/optimizer_stream.h) built on its own
// parts (weight table, gradient ledger), without an engine: a synchronous
// step is the user's Adam on the summed gradients of the calls it takes,
// published at once; an asynchronous one is read by new calls only once the
// next step (or publish_pending) publishes it, and that publish waits for
// the readers of the older version; a fused async step writes staging
// copies that calls of its version upload before the publish. The oracle is
// LibTorch's own torch::optim::Adam on copies of the weights.
#include "runtime/engine/optimizer_stream.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <roundpipe/optim/adam.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <thread>

#include "support/host_cast.h"
#include "test_util.h"

namespace roundpipe::testing {
namespace {

using namespace std::chrono_literals;
using detail::CallState;
using detail::OptimizerStream;

constexpr double kLr = 1e-2;
// Our Adam kernel against torch's composition on the very same gradients:
// both round the same operations, possibly in another order (FMA, SIMD), so
// the weights differ by a few ulps of |w| < 1 (6e-8 each) per step.
constexpr double kKernelRounding = 1e-6;

// The MLP's parameters in a weight table, with the ledger and stats an
// OptimizerStream works on (as Engine's constructor wires them).
struct Parts {
  std::vector<LayerPtr> layers = layers_of(make_model(ModelKind::kMlp));
  detail::WeightTable weights{layers, PinMode::kOff, /*can_pin=*/false, "optimizer test"};
  detail::GradientLedger ledger;
  detail::StatsRecorder stats;
  OptimizerStream stream{this, weights, ledger, stats, std::nullopt, nullptr};

  std::vector<int> ids() const {
    std::vector<int> all;
    for (int id = 0; id < weights.size(); ++id) all.push_back(id);
    return all;
  }
  std::vector<at::Tensor> homes() const {
    std::vector<at::Tensor> out;
    for (int id = 0; id < weights.size(); ++id) out.push_back(weights.home(id).detach().clone());
    return out;
  }
  // A gradient for every parameter (its home's shape), from `seed`.
  std::map<int, at::Tensor> random_grads(uint64_t seed) const {
    auto gen = at::detail::createCPUGenerator(seed);
    std::map<int, at::Tensor> grads;
    for (int id = 0; id < weights.size(); ++id)
      grads[id] = at::randn(weights.home(id).sizes(), gen);
    return grads;
  }
  // A call whose backward stages have delivered `grads` (final), as the
  // gradient tasks leave one.
  std::shared_ptr<CallState> delivered_call(const std::map<int, at::Tensor>& grads) {
    auto call = std::make_shared<CallState>();
    std::vector<int> expected;
    for (const auto& [id, g] : grads) expected.push_back(id);
    ledger.expect(call->grads, expected);
    // (The ledger keeps the tensor it is given and sums into it.)
    for (const auto& [id, g] : grads) ledger.add(call->grads, id, -1, g.clone());
    ledger.delivered(call->grads, expected);
    return call;
  }
  std::vector<at::Tensor> masters() {
    std::vector<at::Tensor> out;
    for (auto& [name, master] : stream.named_masters()) out.push_back(master);
    return out;
  }
};

// torch::optim::Adam on copies of the starting weights.
struct Oracle {
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Adam> adam;
  explicit Oracle(const std::vector<at::Tensor>& start) {
    for (const auto& w : start) params.push_back(w.clone().requires_grad_(true));
    adam =
        std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(kLr).eps(kAdamEps));
  }
  void step(const std::map<int, at::Tensor>& grads) {
    for (const auto& [id, g] : grads) params[id].mutable_grad() = g.clone();
    adam->step();
  }
  std::vector<at::Tensor> weights() const {
    std::vector<at::Tensor> out;
    for (const auto& p : params) out.push_back(p.detach().clone());
    return out;
  }
};

optim::AdamConfig adam_config() {
  return optim::AdamConfig().set_lr(kLr).set_eps(kAdamEps);
}

bool available_now(detail::WeightTable& weights, const std::vector<int>& ids, int64_t version) {
  // (Cancelled at once: whether `version` is available without waiting.)
  return weights.wait_available(ids, version, [] { return true; });
}

TEST(OptimizerStream, ASyncStepIsAdamOnTheSummedGradientsOfItsCallsAndIsLiveAtOnce) {
  Parts p;
  Oracle oracle(p.homes());
  p.stream.prepare_step();  // makes the masters
  optim::Adam adam(p.masters(), adam_config());
  ASSERT_EQ(static_cast<int>(p.masters().size()), p.weights.size());  // all trainable
  for (int step = 1; step <= 2; ++step) {
    // Two calls since the last step: their gradients add up.
    const auto first = p.random_grads(10 * step), second = p.random_grads(10 * step + 1);
    std::map<int, at::Tensor> sum;
    for (const auto& [id, g] : first) sum[id] = g + second.at(id);
    p.stream.prepare_step();
    p.stream.step(
        {p.delivered_call(first), p.delivered_call(second)},
        [&] {
          adam.step();
          adam.zero_grad();
        },
        /*is_async=*/false);
    oracle.step(sum);
    // Returned after the update, which new calls read now.
    EXPECT_EQ(p.stream.version_for_new_calls(), step);
    EXPECT_FALSE(p.stream.update_pending());
    EXPECT_TRUE(available_now(p.weights, p.ids(), step));
    const auto expected = oracle.weights();
    for (int id = 0; id < p.weights.size(); ++id) {
      EXPECT_TENSOR_ABS_NEAR(p.weights.home(id), expected[id], step * kKernelRounding,
                             "step " << step << ", " << p.weights.name(id));
    }
  }
  EXPECT_EQ(p.stats.snapshot().optimizer_updates, 2);
}

TEST(OptimizerStream, AnAsyncStepGoesLiveAtTheNextStepOnceTheOlderVersionsReadsAreDone) {
  Parts p;
  const auto v0 = p.homes();
  Oracle oracle(v0);
  p.stream.prepare_step();
  optim::Adam adam(p.masters(), adam_config());
  auto step_fn = [&] {
    adam.step();
    adam.zero_grad();
  };
  const auto g1 = p.random_grads(21), g2 = p.random_grads(22);
  p.stream.step({p.delivered_call(g1)}, step_fn, /*is_async=*/true);
  // New calls run one update behind: on version 0 until the next step.
  EXPECT_EQ(p.stream.version_for_new_calls(), 0);
  p.stream.drain();
  EXPECT_TRUE(p.stream.update_pending());
  oracle.step(g1);
  const auto v1 = oracle.weights();
  const auto masters = p.masters();
  for (int id = 0; id < p.weights.size(); ++id) {
    EXPECT_TRUE(p.weights.home(id).equal(v0[id])) << "published early: " << p.weights.name(id);
    EXPECT_TENSOR_ABS_NEAR(masters[id], v1[id], kKernelRounding, "master " << p.weights.name(id));
  }
  // A job of a version-0 call is yet to upload: the next step may not
  // publish version 1 over what it will read.
  p.weights.add_reads(p.ids(), 0);
  p.stream.prepare_step();
  p.stream.step({p.delivered_call(g2)}, step_fn, /*is_async=*/true);
  EXPECT_EQ(p.stream.version_for_new_calls(), 1);
  std::this_thread::sleep_for(50ms);
  for (int id = 0; id < p.weights.size(); ++id)
    EXPECT_TRUE(p.weights.home(id).equal(v0[id])) << "published under a read: " << id;
  p.weights.release_reads(p.ids(), 0);
  p.stream.drain();
  for (int id = 0; id < p.weights.size(); ++id)
    EXPECT_TENSOR_ABS_NEAR(p.weights.home(id), v1[id], kKernelRounding, "v1 " << id);
  // synchronize()'s publish: version 2 is live.
  oracle.step(g2);
  const auto v2 = oracle.weights();
  p.stream.publish_pending();
  EXPECT_EQ(p.stream.version_for_new_calls(), 2);
  EXPECT_FALSE(p.stream.update_pending());
  for (int id = 0; id < p.weights.size(); ++id)
    EXPECT_TENSOR_ABS_NEAR(p.weights.home(id), v2[id], 2 * kKernelRounding, "v2 " << id);
}

TEST(OptimizerStream, AFusedAsyncStepWritesStagingCopiesThatItsVersionUploadsBeforeThePublish) {
  Parts p;
  const auto v0 = p.homes();
  Oracle oracle(v0);
  p.stream.prepare_step();
  optim::Adam adam(p.masters(), adam_config());
  const auto g1 = p.random_grads(31);
  p.stream.step_fused({p.delivered_call(g1)}, adam, /*is_async=*/true, nullptr, nullptr);
  EXPECT_EQ(p.stream.version_for_new_calls(), 0);
  p.stream.drain();
  oracle.step(g1);
  const auto v1 = oracle.weights();
  for (int id = 0; id < p.weights.size(); ++id) {
    // Version 1 is available (a call reading it needs no publish), from
    // the staging copy; version 0, the untouched home.
    EXPECT_TRUE(available_now(p.weights, {id}, 1)) << id;
    const auto staged = p.weights.tensors_to_upload({id}, 1).at(0);
    EXPECT_TENSOR_ABS_NEAR(staged, v1[id], kKernelRounding, "staged " << id);
    EXPECT_TRUE(p.weights.tensors_to_upload({id}, 0).at(0).equal(v0[id])) << id;
    EXPECT_TRUE(p.weights.home(id).equal(v0[id])) << id;
  }
  p.stream.publish_pending();
  EXPECT_EQ(p.stream.version_for_new_calls(), 1);
  for (int id = 0; id < p.weights.size(); ++id)
    EXPECT_TENSOR_ABS_NEAR(p.weights.home(id), v1[id], kKernelRounding, "published " << id);
}

// Note [Casts that bypass the cache]: a float16 weight large enough for the
// streaming casts, with float32 masters. The step function sees each
// float16 gradient exactly in float32, and the publish writes the master
// rounded to float16 as copy_ rounds it.
TEST(OptimizerStream, ALargeWeightsGradientAndPublishAreExactCasts) {
  torch::nn::Sequential model(torch::nn::Linear(torch::nn::LinearOptions(2048, 1024).bias(false)));
  model->to(at::kHalf);
  const auto layers = layers_of(model);
  detail::WeightTable weights{layers, PinMode::kOff, /*can_pin=*/false, "large weight"};
  detail::GradientLedger ledger;
  detail::StatsRecorder stats;
  OptimizerStream stream{&weights, weights, ledger, stats, at::kFloat, nullptr};
  stream.prepare_step();
  const auto master = weights.master(0);
  ASSERT_EQ(master.scalar_type(), at::kFloat);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {  // both casts stream
    EXPECT_TRUE(cast_copy_streams(weights.home(0), master));
    EXPECT_TRUE(cast_copy_streams(master, weights.home(0)));
  }
#endif
  optim::Adam adam({master}, adam_config());
  auto gen = at::detail::createCPUGenerator(51);
  for (int step = 1; step <= 2; ++step) {
    const auto g = (at::randn(master.sizes(), gen) * 1e-3).to(at::kHalf);
    auto call = std::make_shared<CallState>();
    ledger.expect(call->grads, {0});
    ledger.add(call->grads, 0, -1, g.clone());
    ledger.delivered(call->grads, {0});
    at::Tensor seen;
    stream.prepare_step();
    stream.step(
        {call},
        [&] {
          seen = master.grad().clone();
          adam.step();
          adam.zero_grad();
        },
        /*is_async=*/false);
    EXPECT_TRUE(seen.equal(g.to(at::kFloat))) << "step " << step << ": the gradient's cast";
    EXPECT_TRUE(weights.home(0).equal(master.to(at::kHalf))) << "step " << step << ": the publish";
  }
}

// A call that failed in the background (its error not yet reported) is
// reported by the step that takes it, and trains nothing.
std::shared_ptr<CallState> failed_call(Parts& p) {
  auto call = p.delivered_call(p.random_grads(41));
  call->fail(StageError("injected backward failure", "backward stage 0 (layers 0..4)", -1, 0,
                        "backward", "sim:0", false));
  return call;
}

TEST(OptimizerStream, AStepOverAFailedCallThrowsItsErrorAndUpdatesNothing) {
  Parts p;
  const auto v0 = p.homes();
  p.stream.prepare_step();
  int updates = 0;
  EXPECT_HAS(message_of([&] {
               p.stream.step(
                   {failed_call(p)}, [&] { ++updates; }, false);
             }),
             "injected backward failure");
  EXPECT_EQ(updates, 0);
  for (int id = 0; id < p.weights.size(); ++id) EXPECT_TRUE(p.weights.home(id).equal(v0[id]));
}

// The version such a step made is still published: new calls read it
// (before, the gradients were gathered outside run_whole's try, the version
// was never published, and the next forward_backward's parameter uploads
// waited for it forever, sync and async alike).
TEST(OptimizerStream, AfterAStepOverAFailedCallNewCallsFindTheirVersion) {
  Parts p;
  p.stream.prepare_step();
  EXPECT_HAS(message_of([&] {
               p.stream.step(
                   {failed_call(p)}, [] {}, false);
             }),
             "injected backward failure");
  EXPECT_TRUE(available_now(p.weights, p.ids(), p.stream.version_for_new_calls()))
      << "version " << p.stream.version_for_new_calls() << " is never published";
}

}  // namespace
}  // namespace roundpipe::testing

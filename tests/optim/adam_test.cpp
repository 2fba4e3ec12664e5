// roundpipe::optim::Adam against torch::optim::Adam / AdamW: every option
// combination, 20 steps, tensors of odd sizes; the fused low-precision path
// against the general path; serialization with torch::save / torch::load.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <roundpipe/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <sstream>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

std::vector<at::Tensor> make_params(uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  std::vector<at::Tensor> params;
  for (int64_t n : {0, 1, 7, 1023, 40001}) params.push_back(at::randn({n}, gen));
  params.push_back(at::randn({33, 65}, gen));
  return params;
}

struct Combo {
  bool amsgrad, maximize, decoupled;
  double weight_decay;
};

TEST(Adam, MatchesTorchOptimForEveryOptionCombination) {
  std::vector<Combo> combos;
  for (bool amsgrad : {false, true})
    for (bool maximize : {false, true})
      for (bool decoupled : {false, true})
        for (double wd : {0.0, 0.1}) combos.push_back({amsgrad, maximize, decoupled, wd});
  for (const auto& c : combos) {
    SCOPED_TRACE(::testing::Message() << "amsgrad=" << c.amsgrad << " maximize=" << c.maximize
                                      << " decoupled=" << c.decoupled << " wd=" << c.weight_decay);
    auto ours = make_params(1), theirs = make_params(1);
    for (auto& t : ours) t.requires_grad_(true);
    for (auto& t : theirs) t.requires_grad_(true);
    optim::Adam adam(ours, optim::AdamConfig()
                               .set_lr(3e-3)
                               .set_betas(0.8, 0.95)
                               .set_eps(1e-6)
                               .set_weight_decay(c.weight_decay)
                               .set_amsgrad(c.amsgrad)
                               .set_maximize(c.maximize)
                               .set_decoupled_weight_decay(c.decoupled));
    std::unique_ptr<torch::optim::Optimizer> reference;
    if (c.decoupled) {
      reference = std::make_unique<torch::optim::AdamW>(theirs, torch::optim::AdamWOptions(3e-3)
                                                                    .betas({0.8, 0.95})
                                                                    .eps(1e-6)
                                                                    .weight_decay(c.weight_decay)
                                                                    .amsgrad(c.amsgrad));
    } else {
      reference = std::make_unique<torch::optim::Adam>(theirs, torch::optim::AdamOptions(3e-3)
                                                                   .betas({0.8, 0.95})
                                                                   .eps(1e-6)
                                                                   .weight_decay(c.weight_decay)
                                                                   .amsgrad(c.amsgrad));
    }
    auto gen = at::detail::createCPUGenerator(7);
    for (int step = 0; step < 20; ++step) {
      for (size_t i = 0; i < ours.size(); ++i) {
        auto g = at::randn(ours[i].sizes(), gen);
        ours[i].mutable_grad() = g.clone();
        // LibTorch has no maximize: it is Adam on the negated gradient.
        theirs[i].mutable_grad() = c.maximize ? -g : g.clone();
      }
      adam.step();
      reference->step();
    }
    // The same gradients, the same formula rounded in another order (our kernel fuses the
    // m, v and p updates into FMAs): p may round differently once a step (1 ulp <= 2^-23 max|p|),
    // and m, v drift by ~2 ulps a step, moving p by < 1.2e-7 over 20 steps at lr 3e-3
    // (< 2e-7 of max|p| >= 0.65).
    const double tol = 20 * std::ldexp(1.0, -23) + 2e-7;  // 2.6e-6
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TENSOR_NEAR(ours[i], theirs[i], tol, "parameter " << i);
    }
  }
}

// Param groups with their own weight decay (what roundpipe-train makes:
// none on norms and biases) against LibTorch's AdamW with the same groups.
TEST(Adam, ParamGroupsTakeTheirOwnWeightDecay) {
  auto ours = make_params(2), theirs = make_params(2);
  for (auto& t : ours) t.requires_grad_(true);
  for (auto& t : theirs) t.requires_grad_(true);
  auto groups_of = [](const std::vector<at::Tensor>& p, auto options) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>(p.begin(), p.begin() + 3));
    auto none = std::make_unique<decltype(options)>(options);
    none->weight_decay(0);
    groups.emplace_back(std::vector<at::Tensor>(p.begin() + 3, p.end()), std::move(none));
    return groups;
  };
  const auto config =
      optim::AdamConfig().set_lr(3e-2).set_weight_decay(0.5).set_decoupled_weight_decay(true);
  optim::Adam adam(groups_of(ours, torch::optim::AdamOptions(3e-2)), config);
  torch::optim::AdamW reference(groups_of(theirs, torch::optim::AdamWOptions(3e-2)),
                                torch::optim::AdamWOptions(3e-2).weight_decay(0.5));
  auto gen = at::detail::createCPUGenerator(9);
  for (int step = 0; step < 10; ++step) {
    for (size_t i = 0; i < ours.size(); ++i) {
      auto g = at::randn(ours[i].sizes(), gen);
      ours[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g;
    }
    adam.step();
    reference.step();
  }
  // As above: a few ulps a step, here at lr 3e-2 over 10 steps.
  const double tol = 1e-5;
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_TENSOR_NEAR(ours[i], theirs[i], tol, "parameter " << i);
  }
}

TEST(Adam, FusedLowPrecisionPathEqualsTheGeneralPath) {
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    for (bool amsgrad : {false, true}) {
      auto masters = make_params(3), general = make_params(3);
      optim::AdamConfig config =
          optim::AdamConfig().set_lr(1e-2).set_amsgrad(amsgrad).set_weight_decay(0.01);
      optim::Adam fused(masters, config), plain(general, config);
      std::vector<at::Tensor> outs;
      for (const auto& m : masters)
        outs.push_back(at::empty(m.sizes(), at::TensorOptions().dtype(dtype)));
      auto gen = at::detail::createCPUGenerator(9);
      for (int step = 0; step < 5; ++step) {
        std::vector<at::Tensor> grads;
        for (const auto& m : masters) grads.push_back(at::randn(m.sizes(), gen).to(dtype));
        fused.fused_step(masters, grads, outs);
        for (size_t i = 0; i < general.size(); ++i)
          general[i].mutable_grad() = grads[i].to(at::kFloat);
        plain.step();
        for (size_t i = 0; i < general.size(); ++i) {
          ASSERT_TRUE(at::equal(masters[i], general[i]))
              << dtype << " master " << i << " step " << step;
          ASSERT_TRUE(at::equal(outs[i], general[i].to(dtype))) << dtype << " weight " << i;
        }
      }
    }
  }
}

TEST(Adam, StateSerializesWithTorchSaveAndLoad) {
  auto a = make_params(5), b = make_params(5);
  optim::Adam first(a, optim::AdamConfig().set_lr(1e-2));
  auto gen = at::detail::createCPUGenerator(2);
  for (int step = 0; step < 3; ++step) {
    for (auto& p : a) p.mutable_grad() = at::randn(p.sizes(), gen);
    first.step();
  }
  std::stringstream buffer;
  torch::save(first, buffer);
  for (size_t i = 0; i < a.size(); ++i) b[i].detach().copy_(a[i]);
  optim::Adam second(b, optim::AdamConfig().set_lr(1e-2));
  torch::load(second, buffer);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      auto g = at::randn(a[i].sizes(), gen);
      a[i].mutable_grad() = g;
      b[i].mutable_grad() = g.clone();
    }
    first.step();
    second.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
}

TEST(Adam, RejectsBadOptions) {
  auto p = make_params(1);
  EXPECT_THROW(optim::Adam(p, optim::AdamConfig().set_lr(-1)), c10::Error);
  EXPECT_THROW(optim::Adam(p, optim::AdamConfig().set_betas(1.0, 0.9)), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing

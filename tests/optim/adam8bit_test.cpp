// 8-bit Adam (optim_bits = 8): the nearest-code table against a search of
// the codes; the vectorised update against the algorithm written in plain
// ATen (decode, Adam, absmax, nearest code), one step at a time from the
// same state; which parameters get 8-bit state; bad input. bitsandbytes
// itself is the oracle of tests/python/test_adam8bit.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <roundpipe/optim/adam.h>

#include <cmath>
#include <limits>

#include "optim/dynamic_map.h"
#include "test_util.h"

namespace roundpipe::testing {
namespace {

// The values where the nearest code changes (midpoints of neighbours), one
// float to each side of them, the codes themselves, and random values over
// the map's range (uniform, and log-uniform down to 1e-11): the arithmetic
// gives the search's code, or where the value lies within rounding of a
// midpoint (a few ulps of the larger code), the other of the two nearest.
TEST(DynamicMap, ArithmeticGivesTheNearestCode) {
  for (bool is_signed : {true, false}) {
    SCOPED_TRACE(is_signed ? "signed" : "unsigned");
    const auto& map = is_signed ? optim::signed_dynamic_map() : optim::unsigned_dynamic_map();
    const auto& code = map.code;
    for (int i = 1; i < 256; ++i) ASSERT_LT(code[i - 1], code[i]) << "codes sorted, index " << i;
    ASSERT_EQ(code[255], 1.0f);
    ASSERT_EQ(optim::nearest_code(code, 0.0f) == 0, !is_signed) << "0 is a code";
    ASSERT_EQ(code[optim::nearest_code(code, 0.0f)], 0.0f);
    std::vector<float> probes;
    for (int i = 0; i < 256; ++i) {
      probes.push_back(code[i]);
      if (i == 0) continue;
      const float mid = code[i - 1] + (code[i] - code[i - 1]) / 2;
      for (float x : {mid, std::nextafter(mid, -2.0f), std::nextafter(mid, 2.0f)})
        probes.push_back(x);
    }
    auto gen = at::detail::createCPUGenerator(7);
    const auto uniform = at::rand({200000}, gen);
    const auto tiny = at::exp(at::rand({200000}, gen) * -25.0);  // 1 down to 1e-11
    for (const auto& t : {uniform, tiny}) {
      const float* x = t.data_ptr<float>();
      for (int64_t i = 0; i < t.numel(); ++i) probes.push_back(is_signed && i % 2 ? -x[i] : x[i]);
    }
    for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, 1e-30f}) probes.push_back(x);
    int64_t differ = 0;
    for (float x : probes) {
      if (!is_signed && x < 0) continue;
      const int ours = map.quantize(x), nearest = optim::nearest_code(code, x);
      if (ours == nearest) continue;
      ++differ;
      ASSERT_EQ(std::abs(ours - nearest), 1) << "value " << x;
      const double gap =
          std::abs(std::abs(x - double(code[ours])) - std::abs(x - double(code[nearest])));
      ASSERT_LE(gap, 4 * std::ldexp(std::max(std::abs(code[ours]), std::abs(code[nearest])), -23))
          << "value " << x << ": code " << ours << " is not as near as " << nearest;
    }
    // Only the probes placed at midpoints (3 a pair of codes) come that close.
    EXPECT_LE(differ, 3 * 255) << "of " << probes.size();
  }
}

// The algorithm, element by element in ATen: decode each moment (its code
// times its block's absmax), Adam's update in torch's order, the new absmax
// of each block, the nearest code of moment / absmax (brute force, the lower
// index on a tie).
struct Reference {
  at::Tensor param, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax;
};

at::Tensor decode(const at::Tensor& codes, const at::Tensor& absmax, bool is_signed) {
  const auto code = optim::dynamic_map_tensor(is_signed);
  const auto scale = absmax.repeat_interleave(optim::kQuantBlock).narrow(0, 0, codes.numel());
  return code.index({codes.reshape(-1).to(at::kLong)}) * scale;
}

std::pair<at::Tensor, at::Tensor> encode(const at::Tensor& values, bool is_signed) {
  const int64_t n = values.numel(), blocks = (n + optim::kQuantBlock - 1) / optim::kQuantBlock;
  const auto padded = at::zeros({blocks * optim::kQuantBlock});
  padded.narrow(0, 0, n).copy_(values);
  const auto absmax = std::get<0>(padded.view({blocks, -1}).abs().max(1));
  const auto inverse = at::where(absmax > 0, absmax.reciprocal(), at::zeros_like(absmax));
  const auto scaled = values * inverse.repeat_interleave(optim::kQuantBlock).narrow(0, 0, n);
  const auto code = optim::dynamic_map_tensor(is_signed);
  const auto codes = (scaled.unsqueeze(1) - code.unsqueeze(0)).abs().argmin(1).to(at::kByte);
  return {codes, absmax};
}

void reference_step(Reference& r, const at::Tensor& grad, int64_t step, const optim::AdamConfig& c,
                    double weight_decay) {
  const auto g = grad.reshape(-1).to(at::kFloat);
  auto p = r.param.reshape(-1);
  auto m = decode(r.exp_avg, r.exp_avg_absmax, true);
  auto v = decode(r.exp_avg_sq, r.exp_avg_sq_absmax, false);
  p.mul_(1 - c.lr * weight_decay);
  m.mul_(c.beta1).add_(g, 1 - c.beta1);
  v.mul_(c.beta2).addcmul_(g, g, 1 - c.beta2);
  const double bc1 = 1 - std::pow(c.beta1, step), bc2 = 1 - std::pow(c.beta2, step);
  p.addcdiv_(m, (v.sqrt() / std::sqrt(bc2)).add_(c.eps), -c.lr / bc1);
  std::tie(r.exp_avg, r.exp_avg_absmax) = encode(m, true);
  std::tie(r.exp_avg_sq, r.exp_avg_sq_absmax) = encode(v, false);
}

// Teacher-forced: each step starts both from the kernel's state. The codes
// agree but where moment / absmax lies within rounding (a few ulps, FMA
// contraction in the kernel) of a midpoint between codes: then they differ
// by one. The parameters differ by the rounding of the decay and the update
// (an ulp each of the largest weight, the update's own error being lr times
// a few ulps), the absmax by a few ulps.
constexpr double kFewUlps = 4.0 / (1 << 23);

TEST(Adam8bit, MatchesTheAlgorithmInPlainATen) {
  const auto config =
      optim::AdamConfig().set_lr(1e-2).set_betas(0.9, 0.99).set_eps(1e-8).set_optim_bits(8);
  const double weight_decay = 0.1;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << "gradient " << dtype);
    auto gen = at::detail::createCPUGenerator(3);
    for (int64_t n : {4096, 5000, 33 * 301}) {
      SCOPED_TRACE(::testing::Message() << n << " elements");
      const int64_t blocks = (n + optim::kQuantBlock - 1) / optim::kQuantBlock;
      auto param = at::randn({n}, gen);
      auto m = at::zeros({n}, at::kByte), v = at::zeros({n}, at::kByte);
      auto m_absmax = at::zeros({blocks}), v_absmax = at::zeros({blocks});
      int64_t codes_differing = 0;
      for (int64_t step = 1; step <= 8; ++step) {
        const auto grad = (at::randn({n}, gen) * (step % 3 == 0 ? 1e-4 : 1.0)).to(dtype);
        Reference r{param.clone(), m.clone(), v.clone(), m_absmax.clone(), v_absmax.clone()};
        reference_step(r, grad, step, config, weight_decay);
        optim::AdamTensors t;
        t.param = param;
        t.grad = grad;
        t.exp_avg = m;
        t.exp_avg_sq = v;
        t.exp_avg_absmax = m_absmax;
        t.exp_avg_sq_absmax = v_absmax;
        t.step = step;
        t.weight_decay = weight_decay;
        optim::adam_update({t}, optim::AdamConfig(config).set_decoupled_weight_decay(true));
        EXPECT_TENSOR_NEAR(param, r.param, kFewUlps, "parameters, step " << step);
        EXPECT_TRUE(at::allclose(m_absmax, r.exp_avg_absmax, 1e-6, 0)) << "step " << step;
        EXPECT_TRUE(at::allclose(v_absmax, r.exp_avg_sq_absmax, 1e-6, 0)) << "step " << step;
        for (const auto& [ours, theirs] : {std::pair{m, r.exp_avg}, std::pair{v, r.exp_avg_sq}}) {
          const auto diff = (ours.to(at::kInt) - theirs.to(at::kInt)).abs();
          EXPECT_LE(diff.max().item<int>(), 1) << "step " << step;
          codes_differing += diff.ne(0).sum().item<int64_t>();
        }
      }
      EXPECT_LE(codes_differing, 2 * 8 * n / 1000) << "codes off by one in more than 0.1%";
    }
  }
}

// bitsandbytes' rule: parameters below min_8bit_size keep float32 moments
// (updated exactly as by float32 Adam); the fused low-precision path writes
// the rounded update.
TEST(Adam8bit, SmallParametersKeepFloatStateAndFusedOutputIsTheRoundedUpdate) {
  auto gen = at::detail::createCPUGenerator(5);
  auto big = at::randn({64, 80}, gen), small = at::randn({100}, gen);
  auto small_by_float_adam = small.clone();
  const auto config = optim::AdamConfig().set_lr(1e-3);
  optim::Adam adam(std::vector<at::Tensor>{big, small},
                   optim::AdamConfig(config).set_optim_bits(8));
  optim::Adam float_adam(std::vector<at::Tensor>{small_by_float_adam}, config);
  for (int step = 0; step < 3; ++step) {
    const auto big_grad = at::randn({64, 80}, gen).to(at::kHalf);
    const auto small_grad = at::randn({100}, gen).to(at::kHalf);
    auto out_big = at::empty({64, 80}, at::kHalf), out_small = at::empty({100}, at::kHalf);
    adam.fused_step({big, small}, {big_grad, small_grad}, {out_big, out_small});
    float_adam.fused_step({small_by_float_adam}, {small_grad}, {at::empty({100}, at::kHalf)});
    EXPECT_TRUE(at::equal(out_big, big.to(at::kHalf))) << "step " << step;
    EXPECT_TRUE(at::equal(out_small, small.to(at::kHalf))) << "step " << step;
    EXPECT_TRUE(at::equal(small, small_by_float_adam)) << "step " << step;
  }
  const auto state_of = [&](const at::Tensor& p) -> const torch::optim::AdamParamState& {
    return static_cast<const torch::optim::AdamParamState&>(
        *adam.state().at(p.unsafeGetTensorImpl()));
  };
  EXPECT_EQ(state_of(big).exp_avg().scalar_type(), at::kByte);
  EXPECT_EQ(state_of(big).exp_avg().sizes(), big.sizes());
  EXPECT_EQ(state_of(small).exp_avg().scalar_type(), at::kFloat);
}

TEST(Adam8bit, BadConfigurationsNameTheFix) {
  auto p = at::zeros({8});
  EXPECT_HAS(message_of([&] {
               optim::Adam(std::vector<at::Tensor>{p}, optim::AdamConfig().set_optim_bits(4));
             }),
             "optim_bits must be 32");
  EXPECT_HAS(message_of([&] {
               optim::Adam(std::vector<at::Tensor>{p},
                           optim::AdamConfig().set_optim_bits(8).set_amsgrad(true));
             }),
             "no amsgrad variant");
  optim::AdamTensors t;
  t.param = at::zeros({300});
  t.grad = at::zeros({300});
  t.exp_avg = at::zeros({300}, at::kByte);
  t.exp_avg_sq = at::zeros({300}, at::kByte);
  t.exp_avg_absmax = at::zeros({1});  // 300 elements are two blocks
  t.exp_avg_sq_absmax = at::zeros({2});
  EXPECT_HAS(message_of([&] { optim::adam_update({t}, optim::AdamConfig().set_optim_bits(8)); }),
             "absmax tensors of 2 blocks");
}

}  // namespace
}  // namespace roundpipe::testing

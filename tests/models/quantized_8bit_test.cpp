// 8-bit base weights (Note [8-bit base weights]) against their definition:
// int8 codes are the float16 weight's row times 127 / its maximum, rounded,
// and come back within half a step; fp8 within e4m3's rounding of the row
// scaled to 448; either rounded once to the weight's dtype; the GPU path
// equal to the CPU path (skipped without a GPU). The comparison with
// bitsandbytes' LLM.int8 quantization is tests/python/test_quantized.py.
#include <gtest/gtest.h>
#include <roundpipe/models/quantized.h>
#include <torch/torch.h>

#include <cmath>

namespace roundpipe::testing {
namespace {

using models::QuantType;

TEST(Quantized8Bit, Int8CodesAreTheRowScaledTo127AndComeBackWithinHalfAStep) {
  torch::manual_seed(7);
  auto w = at::randn({6, 96}) * at::logspace(-3, 1, 6).unsqueeze(1);
  w[3].zero_();  // a row of zeros: codes 0, values 0
  const auto q = models::quantize_8bit(w, QuantType::kInt8);
  ASSERT_EQ(q.values.scalar_type(), at::kChar);
  ASSERT_EQ(q.values.sizes(), w.sizes());
  const auto half = w.to(at::kHalf).to(at::kFloat);  // what bitsandbytes quantizes
  EXPECT_TRUE(at::equal(q.scale, half.abs().amax(1)));
  const auto codes = q.values.to(at::kFloat);
  for (int64_t r = 0; r < w.size(0); ++r) {
    if (r == 3) {
      EXPECT_EQ(codes[r].abs().max().item<float>(), 0.0f);
      continue;
    }
    EXPECT_EQ(codes[r].abs().max().item<float>(), 127.0f) << "row " << r;  // the maximum's code
    // Each code is the nearest integer to value * 127 / max (float32).
    const auto exact = half[r] * (127.0f / q.scale[r].item<float>());
    EXPECT_LE((codes[r] - exact).abs().max().item<float>(), 0.5f + 1e-4f) << "row " << r;
  }
  // Back: within half a step (max / 254) of the float16 weight, and of
  // float32 rounding (relative 2^-23 per operation, two operations).
  const auto back = models::dequantize_8bit(q);
  EXPECT_EQ(back.scalar_type(), at::kFloat);
  const auto bound = (q.scale / 254.0f).unsqueeze(1) * (1 + 1e-6) + half.abs() * 3e-7;
  EXPECT_TRUE(((back - half).abs() <= bound).all().item<bool>());
  EXPECT_TRUE(at::equal(back[3], at::zeros({96})));
}

TEST(Quantized8Bit, Fp8ValuesAreTheRowScaledTo448RoundedToE4m3) {
  torch::manual_seed(8);
  auto w = at::randn({5, 80}) * at::logspace(-4, 2, 5).unsqueeze(1);
  w[1].zero_();
  const auto q = models::quantize_8bit(w, QuantType::kFP8);
  ASSERT_EQ(q.values.scalar_type(), at::kByte);
  const auto amax = w.abs().amax(1);
  for (int64_t r = 0; r < w.size(0); ++r) {
    const float expected = r == 1 ? 1.0f : amax[r].item<float>() / 448.0f;
    EXPECT_EQ(q.scale[r].item<float>(), expected) << "row " << r;
  }
  const auto values = q.values.view(at::kFloat8_e4m3fn).to(at::kFloat);
  // The row's maximum is e4m3's largest value; every value finite.
  EXPECT_TRUE(at::isfinite(values).all().item<bool>());
  EXPECT_EQ(values.abs().amax(1)[0].item<float>(), 448.0f);
  // e4m3 keeps 3 mantissa bits: a normal value within 2^-4 of itself, a
  // subnormal (under 2^-6) within half its step 2^-9; then float32.
  const auto scaled = w / q.scale.unsqueeze(1);
  const auto bound =
      at::maximum(scaled.abs() * std::ldexp(1.0, -4), at::full({}, std::ldexp(1.0, -10)));
  EXPECT_TRUE(((values - scaled).abs() <= bound).all().item<bool>());
  const auto back = models::dequantize_8bit(q);
  EXPECT_TRUE(at::allclose(back, values * q.scale.unsqueeze(1), 0, 0));
  EXPECT_TRUE(at::equal(back[1], at::zeros({80})));
}

TEST(Quantized8Bit, DequantizesToTheWeightsDtypeRoundedOnce) {
  torch::manual_seed(9);
  const auto w = at::randn({8, 64});
  for (const auto type : {QuantType::kInt8, QuantType::kFP8}) {
    for (const auto dtype : {at::kBFloat16, at::kHalf, at::kDouble}) {
      const auto q = models::quantize_8bit(w.to(dtype), type);
      EXPECT_EQ(q.dtype, dtype);
      auto as_float = q;
      as_float.dtype = at::kFloat;
      const auto back = models::dequantize_8bit(q);
      EXPECT_EQ(back.scalar_type(), dtype);
      EXPECT_TRUE(at::equal(back, models::dequantize_8bit(as_float).to(dtype)));
    }
  }
}

TEST(Quantized8Bit, BadInputNamesTheFix) {
  EXPECT_EQ(models::quant_type_from_string("int8"), QuantType::kInt8);
  EXPECT_EQ(models::quant_type_from_string("fp8"), QuantType::kFP8);
  EXPECT_THROW(models::quantize_8bit(at::ones({4}), QuantType::kInt8), c10::ValueError);
  EXPECT_THROW(models::quantize_8bit(at::ones({4, 4}), QuantType::kNF4), c10::ValueError);
  EXPECT_THROW(models::quantize_4bit(at::ones({4, 4}), QuantType::kInt8), c10::ValueError);
  auto q = models::quantize_8bit(at::ones({4, 4}), QuantType::kInt8);
  q.scale = at::ones({3});
  EXPECT_THROW(models::dequantize_8bit(q), c10::ValueError);
}

// Note [8-bit weights, 16 a thread]: the kernel's wide form (16 | cols,
// aligned) and its one-value form (129 columns; values one byte off their
// allocation) give the CPU path's values bit for bit.
TEST(Quantized8Bit, TheGpuPathEqualsTheCpuPathBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU: runs on the GPU machine";
  torch::manual_seed(10);
  const c10::Device gpu(c10::kCUDA, 0);
  for (const auto cols : {129, 512}) {
    const auto w = at::randn({300, cols}) * 0.03;
    for (const auto type : {QuantType::kInt8, QuantType::kFP8}) {
      for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        const auto q = models::quantize_8bit(w.to(dtype), type);
        auto on_gpu = q;
        on_gpu.values = q.values.to(gpu);
        on_gpu.scale = q.scale.to(gpu);
        const auto want = models::dequantize_8bit(q);
        EXPECT_TRUE(at::equal(models::dequantize_8bit(on_gpu).cpu(), want))
            << models::to_string(type) << " " << dtype << " " << cols << " columns";
        // The same values one byte into their storage: the narrow form.
        auto shifted = on_gpu;
        shifted.values = at::empty({q.values.numel() + 1}, on_gpu.values.options())
                             .narrow(0, 1, q.values.numel())
                             .view(q.values.sizes());
        shifted.values.copy_(on_gpu.values);
        EXPECT_TRUE(at::equal(models::dequantize_8bit(shifted).cpu(), want))
            << models::to_string(type) << " " << dtype << " " << cols << " columns, unaligned";
      }
    }
  }
}

}  // namespace
}  // namespace roundpipe::testing

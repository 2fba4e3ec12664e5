// 4-bit base weights (Note [4-bit base weights]) against their definition:
// codes and packing read back by hand, the round trip within half a code
// step of each block, the scales' 8-bit compression within half a step of
// the dynamic map, and the GPU kernel equal to the CPU path bit for bit
// (skipped without a GPU; bench/gpu_tests.sh runs it). The comparison
// with bitsandbytes itself is tests/python/test_quantized.py.
#include <gtest/gtest.h>
#include <roundpipe/device.h>
#include <roundpipe/models/quantized.h>
#include <torch/torch.h>

#include <limits>
#include <thread>

#include "models/modules.h"

namespace roundpipe::testing {
namespace {

using models::QuantType;

int code_at(const models::Quantized4Bit& q, int64_t i) {
  const uint8_t byte = q.packed[i / 2].item<uint8_t>();
  return i % 2 == 0 ? byte >> 4 : byte & 15;
}

TEST(Quantized4Bit, TableValuesTimesTheBlockMaximumComeBackExactly) {
  for (const auto type : {QuantType::kNF4, QuantType::kFP4}) {
    const auto table = models::code_table(type);
    ASSERT_EQ(table.numel(), 16);
    EXPECT_EQ(table.abs().max().item<float>(), 1.0f);
    // Two blocks of 64: the table's values (each 4 times) times 2 and 0.5.
    auto w = at::cat({table.repeat({4}) * 2.0f, table.repeat({4}) * 0.5f}).reshape({2, 64});
    const auto q = models::quantize_4bit(w, type, 64, /*double_quant=*/false);
    EXPECT_EQ(q.packed.numel(), 64);
    EXPECT_EQ(q.absmax[0].item<float>(), 2.0f);
    EXPECT_EQ(q.absmax[1].item<float>(), 0.5f);
    for (int64_t i = 0; i < 128; ++i) {
      const int code = code_at(q, i);
      // (FP4's two zeros are one value: either code is right.)
      EXPECT_EQ(table[code].item<float>(), table[i % 16].item<float>()) << "value " << i;
    }
    EXPECT_TRUE(at::equal(models::dequantize_4bit(q), w)) << models::to_string(type);
  }
  // The even element is the high nibble: NF4's -1 (code 0) then 1 (code 15).
  const auto q = models::quantize_4bit(at::tensor({-3.0f, 3.0f}), QuantType::kNF4, 64, false);
  EXPECT_EQ(q.packed[0].item<uint8_t>(), 0x0F);
}

TEST(Quantized4Bit, ARoundTripIsWithinHalfACodeStepOfEachBlock) {
  torch::manual_seed(3);
  for (const auto type : {QuantType::kNF4, QuantType::kFP4}) {
    const auto table = std::get<0>(models::code_table(type).sort());
    const float widest = (table.slice(0, 1) - table.slice(0, 0, -1)).max().item<float>();
    // 1,000 values: the last block short, an odd count (a padding nibble).
    const auto w = at::randn({1001}) * 0.02;
    const auto q = models::quantize_4bit(w, type, 64, /*double_quant=*/false);
    EXPECT_EQ(q.packed.numel(), 501);
    EXPECT_EQ(q.absmax.numel(), 16);
    const auto back = models::dequantize_4bit(q);
    ASSERT_EQ(back.sizes(), w.sizes());
    for (int64_t b = 0; b < 16; ++b) {
      const auto block = w.slice(0, b * 64, std::min<int64_t>(1001, (b + 1) * 64));
      const float absmax = block.abs().max().item<float>();
      EXPECT_EQ(q.absmax[b].item<float>(), absmax);
      const auto error = (back.slice(0, b * 64, b * 64 + block.numel()) - block).abs().max();
      EXPECT_LE(error.item<float>(), absmax * widest / 2 * (1 + 1e-6f)) << "block " << b;
    }
    // Each value's code is the nearest (a value between codes is no closer
    // to another).
    for (int64_t i = 0; i < 200; ++i) {
      const float scaled = w[i].item<float>() / q.absmax[i / 64].item<float>();
      const float chosen = models::code_table(type)[code_at(q, i)].item<float>();
      EXPECT_LE(std::fabs(chosen - scaled), (table - scaled).abs().min().item<float>() + 1e-6f);
    }
  }
}

TEST(Quantized4Bit, DoubleQuantizedScalesAreWithinHalfAStepOfTheDynamicMap) {
  const auto map = models::dynamic_map_signed();
  ASSERT_EQ(map.numel(), 256);
  EXPECT_TRUE(at::equal(map, std::get<0>(map.sort())));
  EXPECT_EQ(map[127].item<float>(), 0.0f);
  EXPECT_EQ(map[255].item<float>(), 1.0f);
  EXPECT_EQ(map[0].item<float>(), -map[254].item<float>());
  EXPECT_NEAR(map[128].item<float>(), 5.5e-7f, 1e-12f);  // the smallest step: 10^-6 scale
  torch::manual_seed(4);
  // 600 blocks (3 blocks of scales), scales of varied size.
  const auto w = at::randn({600, 64}) * at::rand({600, 1}) * 0.1;
  const auto plain = models::quantize_4bit(w, QuantType::kNF4, 64, false);
  const auto q = models::quantize_4bit(w, QuantType::kNF4, 64, true);
  ASSERT_TRUE(q.double_quantized());
  EXPECT_EQ(q.absmax.scalar_type(), at::kByte);
  EXPECT_EQ(q.nested_absmax.numel(), 3);
  EXPECT_TRUE(at::equal(q.packed, plain.packed)) << "the codes do not depend on the scales' form";
  const float offset = q.nested_offset.item<float>();
  EXPECT_FLOAT_EQ(offset, plain.absmax.mean().item<float>());
  const auto steps = map.slice(0, 1) - map.slice(0, 0, -1);
  for (int64_t b = 0; b < 600; ++b) {
    const float amax2 = q.nested_absmax[b / 256].item<float>();
    const float centered = plain.absmax[b].item<float>() - offset;
    const int code = q.absmax[b].item<uint8_t>();
    const float got = map[code].item<float>() * amax2;
    const float step = steps[std::min(code, 254)].item<float>() +
                       (code > 0 ? steps[code - 1].item<float>() : 0.0f);
    EXPECT_LE(std::fabs(got - centered), step * amax2 / 2 * (1 + 1e-5f)) << "block " << b;
  }
  // Dequantization decodes the scales first: the same values as
  // dequantizing with the decoded scales as float32.
  auto decoded = plain;
  decoded.absmax = map.index({q.absmax.to(at::kLong)}) *
                       q.nested_absmax.repeat_interleave(256).slice(0, 0, 600) +
                   offset;
  EXPECT_TRUE(at::equal(models::dequantize_4bit(q), models::dequantize_4bit(decoded)));
}

TEST(Quantized4Bit, DequantizesToTheWeightsDtypeRoundedOnce) {
  torch::manual_seed(5);
  const auto w = at::randn({8, 64});
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const auto q = models::quantize_4bit(w.to(dtype), QuantType::kNF4, 64, true);
    EXPECT_EQ(q.dtype, dtype);
    auto as_float = q;
    as_float.dtype = at::kFloat;
    const auto back = models::dequantize_4bit(q);
    EXPECT_EQ(back.scalar_type(), dtype);
    EXPECT_TRUE(at::equal(back, models::dequantize_4bit(as_float).to(dtype)));
  }
}

TEST(Quantized4Bit, BadInputNamesTheFix) {
  EXPECT_THROW(models::quant_type_from_string("int4"), c10::ValueError);
  EXPECT_THROW(models::quantize_4bit(at::ones({4}, at::kLong), QuantType::kNF4), c10::ValueError);
  EXPECT_THROW(models::quantize_4bit(at::ones({4}), QuantType::kNF4, 63), c10::ValueError);
  auto q = models::quantize_4bit(at::ones({128}), QuantType::kNF4, 64, false);
  q.shape = {256};
  EXPECT_THROW(models::dequantize_4bit(q), c10::ValueError);
}

TEST(Quantized4Bit, TheGpuKernelEqualsTheCpuPathBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU: runs on the GPU machine";
  torch::manual_seed(6);
  const auto w = at::randn({300, 129}) * 0.03;  // an odd count, a short last block
  for (const auto type : {QuantType::kNF4, QuantType::kFP4}) {
    for (const bool nested : {false, true}) {
      for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        const auto q = models::quantize_4bit(w.to(dtype), type, 64, nested);
        const auto cpu = models::dequantize_4bit(q);
        const auto gpu = models::dequantize_4bit(q.to(c10::Device(c10::kCUDA, 0)));
        EXPECT_TRUE(gpu.is_cuda());
        EXPECT_TRUE(at::equal(gpu.cpu(), cpu))
            << models::to_string(type) << " nested " << nested << " " << dtype;
      }
    }
  }
}

// Note [A wide thread a scale]: the kernel's one-byte form, where the wide
// one cannot go (packed bytes at an odd address; a block size 16 does not
// divide), gives the CPU path's values too.
TEST(Quantized4Bit, TheGpuKernelsNarrowFormEqualsTheCpuPath) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU: runs on the GPU machine";
  torch::manual_seed(7);
  const auto w = at::randn({96, 40}, at::kBFloat16) * 0.05;
  const c10::Device gpu(c10::kCUDA, 0);
  for (const int64_t blocksize : {int64_t{64}, int64_t{18}}) {
    const auto q = models::quantize_4bit(w, QuantType::kNF4, blocksize, /*double_quant=*/true);
    auto on_gpu = q.to(gpu);
    // The same bytes one past an aligned address.
    const auto shifted = at::empty({q.packed.numel() + 1}, on_gpu.packed.options());
    shifted.narrow(0, 1, q.packed.numel()).copy_(on_gpu.packed);
    on_gpu.packed = shifted.narrow(0, 1, q.packed.numel());
    EXPECT_TRUE(at::equal(models::dequantize_4bit(on_gpu).cpu(), models::dequantize_4bit(q)))
        << "block size " << blocksize;
  }
}

// Note [Dequantized weights are not kept]: a projection on a quantized base
// keeps its packed weight for the backward, not the dequantized one (the
// simulated device charges what the forward leaves allocated), and gives
// the gradients autograd gives through at::linear on the dequantized weight.
// (In float32, a sum of n products differs between two summation orders by
// at most 2 n u times the sum of the products' magnitudes.)
TEST(QuantizedLinear, KeepsThePackedWeightAndGivesAutogradsGradients) {
  constexpr int64_t in = 1024, out = 512, rows = 8;  // a float32 weight of 2 MiB
  const double u = std::numeric_limits<float>::epsilon() / 2;
  for (const auto type : {QuantType::kNF4, QuantType::kInt8}) {
    auto devices = make_devices("sim:1,mem=64MiB");
    auto& device = *devices.front();
    models::detail::Linear linear(in, out, /*bias=*/true, models::LoraOptions{},
                                  models::BaseQuantization{type, true});
    torch::manual_seed(11);
    linear->base.set(at::randn({out, in}) * 0.05);
    {
      c10::NoGradGuard no_grad;
      linear->bias.copy_(at::randn({out}));
    }
    linear->bias.requires_grad_(true);
    const auto x = at::randn({rows, in}).requires_grad_();
    const auto grad = at::randn({rows, out});
    int64_t kept = 0;
    std::thread compute([&] {  // a thread working for the device, as its worker does
      device.bind_compute_thread();
      const auto before = device.memory_stats().in_use_bytes;
      auto y = linear->forward(x);
      kept = device.memory_stats().in_use_bytes - before;
      y.backward(grad);
    });
    compute.join();
    // The output (16 KiB) and no weight: at::linear's own backward kept
    // the 2 MiB dequantized weight.
    EXPECT_LT(kept, out * in * 4 / 8) << models::to_string(type);

    const auto w = linear->base.dequantize(at::kFloat);
    const auto x2 = x.detach().requires_grad_();
    const auto b2 = linear->bias.detach().requires_grad_();
    at::linear(x2, w, b2).backward(grad);
    const auto x_bound = 2 * out * u * grad.abs().mm(w.abs());
    EXPECT_TRUE((x.grad() - x2.grad()).abs().le(x_bound).all().item<bool>())
        << models::to_string(type);
    const auto b_bound = 2 * rows * u * grad.abs().sum(0);
    EXPECT_TRUE((linear->bias.grad() - b2.grad()).abs().le(b_bound).all().item<bool>());
  }
}

}  // namespace
}  // namespace roundpipe::testing

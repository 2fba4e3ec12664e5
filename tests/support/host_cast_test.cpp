// cast_copy (support/host_cast.h, Note [Casts that bypass the cache]):
// what dst.copy_(src) writes, bit for bit, in every class of value
// (random bit patterns over the whole float32 range, exact ties of both
// narrow types, subnormals, overflow, infinities, signed zeros; a NaN stays
// a NaN), from any alignment; the streaming path is taken where the CPU has
// AVX2 and F16C, and copy_ is used elsewhere (other dtypes, strides, small,
// negated views, misaligned or overlapping memory).
#include "support/host_cast.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace roundpipe::testing {
namespace {

bool cpu_streams() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

at::Tensor random_bits(int64_t n) {
  return at::randint(0, int64_t{1} << 32, {n}, at::kLong).to(at::kInt);
}

// float32 values of every class, n of them (n >= 64).
at::Tensor float_values(int64_t n) {
  const int64_t part = n / 4;
  auto bits = random_bits(n);  // every exponent, NaNs, infinities, subnormals
  // bfloat16 ties: the dropped half exactly 0x8000 (even and odd kept parts).
  auto b = bits.narrow(0, part, part);
  b.copy_(at::bitwise_or(at::bitwise_and(b, static_cast<int32_t>(0xFFFF0000u)), 0x8000));
  // float16 ties: a normal float16 value plus half its last place (bit 12 of
  // the float32 mantissa), exponents 2^-14 .. 2^15.
  auto h = bits.narrow(0, 2 * part, part);
  const auto exponent = at::randint(113, 143, {part}, at::kInt);
  const auto mantissa = at::bitwise_and(random_bits(part), 0x7FE000);  // float16's 10 bits
  const auto sign = at::bitwise_and(random_bits(part), static_cast<int32_t>(0x80000000u));
  h.copy_(
      sign.bitwise_or(exponent.bitwise_left_shift(23)).bitwise_or(mantissa).bitwise_or(1 << 12));
  auto values = bits.view(at::kFloat);
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            65504.0f,   // float16's largest
                            65519.99f,  // rounds down to it
                            65520.0f,   // the tie that rounds to infinity
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(),
                            5.9604645e-08f,  // float16's smallest subnormal
                            2.9802322e-08f,  // half of it: a tie to zero
                            1.0f,
                            -3.0f};
  for (size_t i = 0; i < std::size(specials); ++i) values[n - 1 - i] = specials[i];
  return values;
}

// The same bits where `want` is a number; a NaN where it is one.
void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  const auto nan = want.isnan();
  EXPECT_TRUE(at::equal(got.isnan(), nan)) << what << ": NaNs differ";
  const auto size = want.element_size();
  const auto int_type = size == 8 ? at::kLong : size == 4 ? at::kInt : at::kShort;
  EXPECT_TRUE(
      at::equal(got.view(int_type).masked_select(~nan), want.view(int_type).masked_select(~nan)))
      << what << ": values differ";
}

// A tensor of n values starting `offset` elements into its storage.
at::Tensor at_offset(int64_t n, int64_t offset, at::ScalarType dtype) {
  return at::empty({n + offset}, dtype).narrow(0, offset, n);
}

TEST(HostCast, NarrowingWritesWhatCopyWritesBitForBit) {
  const int64_t n = (int64_t{4} << 20) / 2 + 8 * 37 + 5;  // over 4 MiB of 16-bit values
  const auto source = float_values(n);
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    for (const int64_t offset : {0, 1, 3}) {
      auto src = at_offset(n, 2 * offset, at::kFloat).copy_(source);
      auto dst = at_offset(n, offset, dtype);
      EXPECT_EQ(cast_copy_streams(dst, src), cpu_streams());
      cast_copy(dst, src);
      expect_same(dst, at::empty({n}, dtype).copy_(src),
                  std::string(c10::toString(dtype)) + " offset " + std::to_string(offset));
    }
  }
}

TEST(HostCast, WideningWritesWhatCopyWritesBitForBit) {
  // Every 16-bit pattern, repeated past 4 MiB of float32.
  const int64_t n = (int64_t{4} << 20) / 4 + 8 * 11 + 3;
  const auto patterns = at::arange(n, at::kInt).remainder(65536).sub(32768).to(at::kShort);
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    for (const int64_t offset : {0, 1, 5}) {
      auto src = at_offset(n, offset, dtype);
      src.view(at::kShort).copy_(patterns);
      auto dst = at_offset(n, 3 * offset, at::kFloat);
      EXPECT_EQ(cast_copy_streams(dst, src), cpu_streams());
      cast_copy(dst, src);
      expect_same(dst, at::empty({n}, at::kFloat).copy_(src),
                  std::string(c10::toString(dtype)) + " offset " + std::to_string(offset));
    }
  }
}

TEST(HostCast, OtherCasesAreCopyAndEveryWriteCountsAsInPlace) {
  const auto big = float_values(int64_t{3} << 20);
  struct Case {
    at::Tensor dst, src;
    const char* what;
  };
  const std::vector<Case> cases = {
      {at::empty({1000}, at::kHalf), big.narrow(0, 0, 1000), "small"},
      {at::empty({int64_t{3} << 20}, at::kDouble), big, "float64"},
      {at::empty({int64_t{3} << 20}, at::kFloat), big.to(at::kHalf), "streams"},
      {at::empty({int64_t{3} << 19}, at::kHalf), big.view({-1, 2}).select(1, 0), "strided"},
      {at::empty({int64_t{3} << 20}, at::kFloat), big, "same dtype"},
  };
  // Not whole elements apart: a float32 destination 2 bytes off its
  // alignment, and one overlapping its source (copy_'s to refuse).
  auto bytes = at::empty({(int64_t{3} << 22) + 16}, at::kByte);
  const auto misaligned =
      at::from_blob(bytes.data_ptr<uint8_t>() + 2, {int64_t{3} << 20}, at::kFloat);
  EXPECT_FALSE(cast_copy_streams(misaligned, big.to(at::kHalf)));
  const auto overlapping =
      at::from_blob(bytes.data_ptr<uint8_t>() + 16, {int64_t{3} << 20}, at::kHalf);
  EXPECT_FALSE(cast_copy_streams(misaligned, overlapping));
  EXPECT_FALSE(cast_copy_streams(at::empty({int64_t{3} << 20}, at::kHalf), big._neg_view()));
  for (const auto& c : cases) {
    if (std::string(c.what) != "streams") EXPECT_FALSE(cast_copy_streams(c.dst, c.src)) << c.what;
    const auto version = c.dst._version();
    cast_copy(c.dst, c.src);
    EXPECT_EQ(c.dst._version(), version + 1) << c.what;
    expect_same(c.dst, at::empty_like(c.dst).copy_(c.src), c.what);
  }
}

}  // namespace
}  // namespace roundpipe::testing

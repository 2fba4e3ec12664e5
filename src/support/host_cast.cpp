#include "support/host_cast.h"

#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "support/parallel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace roundpipe {

// Note [Casts that bypass the cache]
// Each step with the caller's step function makes two passes over every
// trainable parameter besides Adam's: its low-precision gradient cast into
// the float32 master's .grad, and the publish of the new master into the
// low-precision weight. These arrays are far larger than any cache, so an
// ordinary store first reads the line it writes (a read for ownership):
// the cast moved 2 + 4 + 4 bytes a parameter for 6 of data, the publish
// 4 + 2 + 2 for 6. Streaming stores write whole lines without reading them.
// On the 2-core dev machine, with 268M float16 parameters
// (bench/step_function_bench.py), a step's update (cast and Adam) went from
// 0.229-0.234 s to 0.202-0.204 and its publish from 0.059-0.061 s to
// 0.048-0.052 (bench/README.md, "Casts that bypass the cache"). Where the
// host's memory bandwidth bounds the optimizer (on one H100 host the
// Llama-3.2-3B shape's update took 2.2-3.8 s and bounded the step), those
// bytes are the step's. The values are copy_'s: float16 <-> float32 by the
// F16C instructions torch's own vectorised copy uses (round to nearest
// even), bfloat16 -> float32 exact, float32 -> bfloat16 rounded to nearest
// even as c10::BFloat16 does (a NaN becomes 0x7FC0, as c10's does; torch's
// vectorised copy writes 0xFFFF, also a NaN). The few values before the
// first aligned store and after the last go through c10's scalar
// conversions.

namespace {

constexpr int64_t kMinStreamBytes = int64_t{4} << 20;
constexpr int64_t kPieceValues = int64_t{1} << 18;  // 1 MiB of float32 a task

bool is_low(c10::ScalarType t) {
  return t == c10::kHalf || t == c10::kBFloat16;
}

#if defined(__x86_64__)
bool cpu_has_avx2_f16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

// Eight values a step; `out` aligned to 32 bytes (float32) or 16 (16-bit).
__attribute__((target("avx2,f16c"))) void half_to_float(const c10::Half* in, float* out,
                                                        int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_stream_ps(out + i, _mm256_cvtph_ps(h));
  }
  _mm_sfence();
}

__attribute__((target("avx2,f16c"))) void bfloat16_to_float(const c10::BFloat16* in, float* out,
                                                            int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16);
    _mm256_stream_ps(out + i, _mm256_castsi256_ps(wide));
  }
  _mm_sfence();
}

__attribute__((target("avx2,f16c"))) void float_to_half(const float* in, c10::Half* out,
                                                        int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  _mm_sfence();
}

__attribute__((target("avx2,f16c"))) void float_to_bfloat16(const float* in, c10::BFloat16* out,
                                                            int64_t n) {
  const __m256i one = _mm256_set1_epi32(1), half_ulp = _mm256_set1_epi32(0x7FFF);
  const __m256i quiet_nan = _mm256_set1_epi32(0x7FC0);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(in + i);
    const __m256i bits = _mm256_castps_si256(v);
    // Round to nearest even: add 0x7FFF plus the kept part's lowest bit.
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i kept = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half_ulp, odd)), 16);
    const __m256i is_number = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
    kept = _mm256_blendv_epi8(quiet_nan, kept, is_number);
    // Every lane is at most 0xFFFF: the unsigned pack keeps it.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(kept), _mm256_extracti128_si256(kept, 1));
    _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), packed);
  }
  _mm_sfence();
}
#else
bool cpu_has_avx2_f16c() {
  return false;
}
#endif

template <typename Out, typename In>
void scalar_cast(const In* in, Out* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Out>(static_cast<float>(in[i]));
}

// Head values one by one until `out` is aligned for the streaming stores,
// the middle in pieces on the pool, the tail one by one.
template <typename Out, typename In>
void cast_in_pieces(const In* in, Out* out, int64_t n, void (*kernel)(const In*, Out*, int64_t)) {
  constexpr int64_t kAlign = sizeof(Out) == 4 ? 32 : 16;
  const auto address = reinterpret_cast<uintptr_t>(out);
  int64_t head = static_cast<int64_t>(((kAlign - address % kAlign) % kAlign) / sizeof(Out));
  head = std::min(head, n);
  scalar_cast(in, out, head);
  const int64_t body = (n - head) / 8 * 8;
  const int64_t pieces = (body + kPieceValues - 1) / kPieceValues;
  parallel_for_each(pieces, [&](int64_t p) {
    const int64_t begin = head + p * kPieceValues;
    kernel(in + begin, out + begin, std::min(kPieceValues, head + body - begin));
  });
  scalar_cast(in + head + body, out + head + body, n - head - body);
}

}  // namespace

bool cast_copy_streams(const at::Tensor& dst, const at::Tensor& src) {
  const auto to = dst.scalar_type(), from = src.scalar_type();
  const bool pair = (to == c10::kFloat && is_low(from)) || (is_low(to) && from == c10::kFloat);
  if (!(pair && cpu_has_avx2_f16c() && dst.device().is_cpu() && src.device().is_cpu() &&
        dst.sizes() == src.sizes() && dst.is_contiguous() && src.is_contiguous() && !dst.is_neg() &&
        !src.is_neg() && dst.numel() * dst.element_size() >= kMinStreamBytes)) {
    return false;
  }
  // Whole elements apart from each other: an element-aligned dst (the
  // head's arithmetic), and no overlap (copy_ handles that).
  const auto dst_at = reinterpret_cast<uintptr_t>(dst.const_data_ptr());
  const auto src_at = reinterpret_cast<uintptr_t>(src.const_data_ptr());
  const auto dst_end = dst_at + dst.numel() * dst.element_size();
  const auto src_end = src_at + src.numel() * src.element_size();
  return dst_at % dst.element_size() == 0 && (dst_end <= src_at || src_end <= dst_at);
}

void cast_copy(const at::Tensor& dst, const at::Tensor& src) {
  if (!cast_copy_streams(dst, src)) {
    c10::NoGradGuard no_grad;
    dst.copy_(src);
    return;
  }
#if defined(__x86_64__)
  const int64_t n = dst.numel();
  if (dst.scalar_type() == c10::kFloat && src.scalar_type() == c10::kHalf) {
    cast_in_pieces(src.const_data_ptr<c10::Half>(), dst.data_ptr<float>(), n, half_to_float);
  } else if (dst.scalar_type() == c10::kFloat) {
    cast_in_pieces(src.const_data_ptr<c10::BFloat16>(), dst.data_ptr<float>(), n,
                   bfloat16_to_float);
  } else if (dst.scalar_type() == c10::kHalf) {
    cast_in_pieces(src.const_data_ptr<float>(), dst.data_ptr<c10::Half>(), n, float_to_half);
  } else {
    cast_in_pieces(src.const_data_ptr<float>(), dst.data_ptr<c10::BFloat16>(), n,
                   float_to_bfloat16);
  }
  dst.unsafeGetTensorImpl()->bump_version();
#endif
}

}  // namespace roundpipe

// The Adam8bit loop, one block of kQuantBlock elements at a time: decode
// both moments, update them and the parameter as adam_kernel.cpp does
// (torch's operation order), take each moment's new absmax over the block,
// and store the nearest codes under it (Note [Nearest code by arithmetic]).
// bitsandbytes' 8-bit blockwise Adam does the same arithmetic; its update
// is the oracle of tests/python/test_adam8bit.py. Built like adam_kernel.cpp
// (target_clones, -O3).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "optim/adam_kernel.h"
#include "optim/dynamic_map.h"

namespace roundpipe::optim::kernel {
namespace {

// The largest of x[0..n), all >= 0 (or NaN, which wins): non-negative
// floats order as their bit patterns, and an integer maximum vectorises
// where a float one (NaN rules) does not.
__attribute__((always_inline)) inline float block_max(const float* __restrict x, int n) {
  uint32_t best = 0;
  for (int i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    best = bits > best ? bits : best;
  }
  float out;
  std::memcpy(&out, &best, sizeof out);
  return out;
}

template <typename Grad, typename Out>
__attribute__((always_inline)) inline void adam8bit_loop(float* __restrict p,
                                                         const Grad* __restrict grad,
                                                         const QuantizedMoments& q,
                                                         Out* __restrict out, int64_t n,
                                                         const AdamScalars& s) {
  // (Copies: the code stores, being bytes, may alias anything, and would
  // make the compiler reload the maps' constants for every element.)
  const DynamicMap m_map = signed_dynamic_map();
  const DynamicMap v_map = unsigned_dynamic_map();
  const float* __restrict m_code = m_map.code.data();
  const float* __restrict v_code = v_map.code.data();
  const float b1 = s.beta1, c1 = s.one_minus_beta1, b2 = s.beta2, c2 = s.one_minus_beta2;
  const float l2 = s.l2_decay, keep = s.decoupled_keep, sign = s.grad_sign;
  const float sbc2 = s.sqrt_bias_correction2, eps = s.eps, step = s.neg_step_size;
  alignas(64) float m[kQuantBlock], m_abs[kQuantBlock], v[kQuantBlock];
  for (int64_t start = 0, block = 0; start < n; start += kQuantBlock, ++block) {
    const int len = static_cast<int>(std::min<int64_t>(kQuantBlock, n - start));
    uint8_t* __restrict mq = q.exp_avg + start;
    uint8_t* __restrict vq = q.exp_avg_sq + start;
    const float m_scale = q.exp_avg_absmax[block], v_scale = q.exp_avg_sq_absmax[block];
    float* __restrict pb = p + start;
    const Grad* __restrict gb = grad + start;
#pragma GCC ivdep
    for (int i = 0; i < len; ++i) {
      const float w = pb[i];
      const float g = sign * to_float(gb[i]) + l2 * w;
      const float mi = (m_code[mq[i]] * m_scale) * b1 + c1 * g;
      const float vi = (v_code[vq[i]] * v_scale) * b2 + c2 * (g * g);
      m[i] = mi;
      m_abs[i] = std::fabs(mi);
      v[i] = vi;
      const float denom = std::sqrt(vi) / sbc2 + eps;
      const float updated = w * keep + step * (mi / denom);
      pb[i] = updated;
      if constexpr (!std::is_same_v<Out, void>) out[start + i] = static_cast<Out>(updated);
    }
    const float m_max = block_max(m_abs, len), v_max = block_max(v, len);
    const float m_inv = m_max > 0 ? 1.0f / m_max : 0.0f;
    const float v_inv = v_max > 0 ? 1.0f / v_max : 0.0f;
    // (One loop a moment: each map's constants fill the vector registers.)
    for (int i = 0; i < len; ++i) mq[i] = m_map.quantize(m[i] * m_inv);
    for (int i = 0; i < len; ++i) vq[i] = v_map.quantize(v[i] * v_inv);
    q.exp_avg_absmax[block] = m_max;
    q.exp_avg_sq_absmax[block] = v_max;
  }
}

#define ROUNDPIPE_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

ROUNDPIPE_CLONES void f32(float* p, const float* g, const QuantizedMoments& q, int64_t n,
                          const AdamScalars& s) {
  adam8bit_loop<float, void>(p, g, q, nullptr, n, s);
}
ROUNDPIPE_CLONES void f16(float* p, const c10::Half* g, const QuantizedMoments& q, c10::Half* out,
                          int64_t n, const AdamScalars& s) {
  adam8bit_loop<c10::Half, c10::Half>(p, g, q, out, n, s);
}
ROUNDPIPE_CLONES void bf16(float* p, const c10::BFloat16* g, const QuantizedMoments& q,
                           c10::BFloat16* out, int64_t n, const AdamScalars& s) {
  adam8bit_loop<c10::BFloat16, c10::BFloat16>(p, g, q, out, n, s);
}

}  // namespace

void adam8bit_f32(float* param, const float* grad, const QuantizedMoments& q, int64_t n,
                  const AdamScalars& s) {
  f32(param, grad, q, n, s);
}
void adam8bit_f16(float* param, const c10::Half* grad, const QuantizedMoments& q, c10::Half* out,
                  int64_t n, const AdamScalars& s) {
  f16(param, grad, q, out, n, s);
}
void adam8bit_bf16(float* param, const c10::BFloat16* grad, const QuantizedMoments& q,
                   c10::BFloat16* out, int64_t n, const AdamScalars& s) {
  bf16(param, grad, q, out, n, s);
}

}  // namespace roundpipe::optim::kernel

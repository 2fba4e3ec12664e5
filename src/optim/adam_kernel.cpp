// The Adam loop. Written plainly so the compiler vectorises it; GCC's
// target_clones builds it for x86-64-v4 (AVX-512), v3 (AVX2+FMA) and the baseline and picks
// one at load time. The amsgrad choice is a template parameter, so the loop
// itself has no branches. Operation order follows torch::optim::Adam:
//   g = sign * grad + l2 * p;  p *= keep (AdamW);
//   m = m * b1 + (1 - b1) * g;  v = v * b2 + (1 - b2) * g * g;
//   denom = sqrt(v or max(vmax, v)) / sqrt(bc2) + eps;  p += -step * (m / denom)
#include "optim/adam_kernel.h"

#include <algorithm>
#include <cmath>

namespace roundpipe::optim::kernel {
namespace {

template <bool kAmsgrad, typename Grad, typename Out>
__attribute__((always_inline)) inline void adam_loop(float* __restrict p,
                                                     const Grad* __restrict grad,
                                                     float* __restrict m, float* __restrict v,
                                                     float* __restrict vmax, Out* __restrict out,
                                                     int64_t n, const AdamScalars& s) {
  const float b1 = s.beta1, c1 = s.one_minus_beta1, b2 = s.beta2, c2 = s.one_minus_beta2;
  const float l2 = s.l2_decay, keep = s.decoupled_keep, sign = s.grad_sign;
  const float sbc2 = s.sqrt_bias_correction2, eps = s.eps, step = s.neg_step_size;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    const float w = p[i];
    const float g = sign * to_float(grad[i]) + l2 * w;
    const float mi = m[i] * b1 + c1 * g;
    const float vi = v[i] * b2 + c2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    float second = vi;
    if constexpr (kAmsgrad) {
      second = vmax[i] > vi ? vmax[i] : vi;
      vmax[i] = second;
    }
    const float denom = std::sqrt(second) / sbc2 + eps;
    const float updated = w * keep + step * (mi / denom);
    p[i] = updated;
    if constexpr (!std::is_same_v<Out, void>) out[i] = static_cast<Out>(updated);
  }
}

#define ROUNDPIPE_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

ROUNDPIPE_CLONES void f32_plain(float* p, const float* g, float* m, float* v, int64_t n,
                                const AdamScalars& s) {
  adam_loop<false, float, void>(p, g, m, v, nullptr, nullptr, n, s);
}
ROUNDPIPE_CLONES void f32_ams(float* p, const float* g, float* m, float* v, float* vmax, int64_t n,
                              const AdamScalars& s) {
  adam_loop<true, float, void>(p, g, m, v, vmax, nullptr, n, s);
}
ROUNDPIPE_CLONES void f16_plain(float* p, const c10::Half* g, float* m, float* v, c10::Half* out,
                                int64_t n, const AdamScalars& s) {
  adam_loop<false, c10::Half, c10::Half>(p, g, m, v, nullptr, out, n, s);
}
ROUNDPIPE_CLONES void f16_ams(float* p, const c10::Half* g, float* m, float* v, float* vmax,
                              c10::Half* out, int64_t n, const AdamScalars& s) {
  adam_loop<true, c10::Half, c10::Half>(p, g, m, v, vmax, out, n, s);
}
ROUNDPIPE_CLONES void bf16_plain(float* p, const c10::BFloat16* g, float* m, float* v,
                                 c10::BFloat16* out, int64_t n, const AdamScalars& s) {
  adam_loop<false, c10::BFloat16, c10::BFloat16>(p, g, m, v, nullptr, out, n, s);
}
ROUNDPIPE_CLONES void bf16_ams(float* p, const c10::BFloat16* g, float* m, float* v, float* vmax,
                               c10::BFloat16* out, int64_t n, const AdamScalars& s) {
  adam_loop<true, c10::BFloat16, c10::BFloat16>(p, g, m, v, vmax, out, n, s);
}

// Sum of squares in float over kLanes independent accumulators (so the
// compiler vectorises the loop without reassociating one sum), each lane
// adding at most kBlock squares before the lanes go into a double sum: the
// float rounding stays within kBlock x 2^-24 = 1.5e-5 of the sum.
template <typename Grad>
__attribute__((always_inline)) inline double squares_loop(const Grad* __restrict g, int64_t n) {
  constexpr int kLanes = 32, kBlock = 256;
  double sum = 0;
  int64_t i = 0;
  while (n - i >= kLanes) {
    float acc[kLanes] = {};
    const int64_t end = i + std::min<int64_t>((n - i) / kLanes, kBlock) * kLanes;
    for (; i < end; i += kLanes) {
#pragma GCC unroll 32
      for (int l = 0; l < kLanes; ++l) {
        const float x = to_float(g[i + l]);
        acc[l] += x * x;
      }
    }
    for (int l = 0; l < kLanes; ++l) sum += acc[l];
  }
  for (; i < n; ++i) {
    const double x = to_float(g[i]);
    sum += x * x;
  }
  return sum;
}
ROUNDPIPE_CLONES double squares_f32(const float* g, int64_t n) {
  return squares_loop(g, n);
}
ROUNDPIPE_CLONES double squares_f16(const c10::Half* g, int64_t n) {
  return squares_loop(g, n);
}
ROUNDPIPE_CLONES double squares_bf16(const c10::BFloat16* g, int64_t n) {
  return squares_loop(g, n);
}

}  // namespace

double sum_of_squares(const float* g, int64_t n) {
  return squares_f32(g, n);
}
double sum_of_squares(const c10::Half* g, int64_t n) {
  return squares_f16(g, n);
}
double sum_of_squares(const c10::BFloat16* g, int64_t n) {
  return squares_bf16(g, n);
}

void adam_f32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
              float* max_exp_avg_sq, int64_t n, const AdamScalars& s) {
  if (max_exp_avg_sq) {
    f32_ams(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, n, s);
  } else {
    f32_plain(param, grad, exp_avg, exp_avg_sq, n, s);
  }
}
void adam_f16(float* param, const c10::Half* grad, float* exp_avg, float* exp_avg_sq,
              float* max_exp_avg_sq, c10::Half* out, int64_t n, const AdamScalars& s) {
  if (max_exp_avg_sq) {
    f16_ams(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out, n, s);
  } else {
    f16_plain(param, grad, exp_avg, exp_avg_sq, out, n, s);
  }
}
void adam_bf16(float* param, const c10::BFloat16* grad, float* exp_avg, float* exp_avg_sq,
               float* max_exp_avg_sq, c10::BFloat16* out, int64_t n, const AdamScalars& s) {
  if (max_exp_avg_sq) {
    bf16_ams(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out, n, s);
  } else {
    bf16_plain(param, grad, exp_avg, exp_avg_sq, out, n, s);
  }
}

const char* adam_kernel_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4 (AVX-512)";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3 (AVX2+FMA)";
  return "baseline x86-64";
}

}  // namespace roundpipe::optim::kernel

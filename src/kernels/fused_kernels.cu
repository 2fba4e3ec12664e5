// Fused elementwise kernels of the model presets. Each replaces a chain of
// LibTorch ops that read and write the whole activation several times (the
// profile of a Qwen3 layer spent about half its device time there) by one
// pass that keeps intermediates in registers. Arithmetic is in float, loads
// and stores in 16-byte packs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "fused_kernels.h"

namespace roundpipe::kernels {
namespace {

__device__ __forceinline__ float to_float(float v) {
  return v;
}
__device__ __forceinline__ float to_float(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Rounds v to T and back: where LibTorch stores an intermediate in T, so do we.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// 16 bytes of T.
template <typename T>
struct alignas(16) Pack {
  static constexpr int n = 16 / sizeof(T);
  T v[n];
};

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

int launched() {
  return static_cast<int>(cudaGetLastError());
}

unsigned blocks_for(int64_t items, int threads) {
  const int64_t blocks = (items + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

// ------------------------------------------------------------------ RMSNorm

constexpr int kRowsPerBlock = 8;  // one warp per row

template <typename T>
__global__ void rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                        T* __restrict__ y, float* __restrict__ rstd, int64_t rows,
                                        int dim, float eps) {
  using P = Pack<T>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const P* xr = reinterpret_cast<const P*>(x + row * dim);
  const P* wr = reinterpret_cast<const P*>(weight);
  P* yr = reinterpret_cast<P*>(y + row * dim);
  const int packs = dim / P::n;
  float squares = 0.f;
  for (int i = lane; i < packs; i += 32) {
    const P p = xr[i];
#pragma unroll
    for (int j = 0; j < P::n; ++j) {
      const float f = to_float(p.v[j]);
      squares += f * f;
    }
  }
  const float r = rsqrtf(warp_sum(squares) / dim + eps);
  if (lane == 0) rstd[row] = r;
  for (int i = lane; i < packs; i += 32) {
    const P p = xr[i], w = wr[i];
    P out;
#pragma unroll
    for (int j = 0; j < P::n; ++j)
      out.v[j] = from_float<T>(to_float(w.v[j]) * round_to<T>(to_float(p.v[j]) * r));
    yr[i] = out;
  }
}

// dx = rstd * (dn - xhat * mean(dn * xhat)), dn = dy * weight (rounded to T
// as LibTorch's product is), xhat = x * rstd.
template <typename T>
__global__ void rms_norm_backward_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                            const T* __restrict__ weight,
                                            const float* __restrict__ rstd, T* __restrict__ dx,
                                            int64_t rows, int dim) {
  using P = Pack<T>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const P* gr = reinterpret_cast<const P*>(dy + row * dim);
  const P* xr = reinterpret_cast<const P*>(x + row * dim);
  const P* wr = reinterpret_cast<const P*>(weight);
  P* dxr = reinterpret_cast<P*>(dx + row * dim);
  const int packs = dim / P::n;
  const float r = rstd[row];
  float dot = 0.f;
  for (int i = lane; i < packs; i += 32) {
    const P g = gr[i], p = xr[i], w = wr[i];
#pragma unroll
    for (int j = 0; j < P::n; ++j)
      dot += round_to<T>(to_float(g.v[j]) * to_float(w.v[j])) * to_float(p.v[j]) * r;
  }
  const float mean_dot = warp_sum(dot) / dim;
  for (int i = lane; i < packs; i += 32) {
    const P g = gr[i], p = xr[i], w = wr[i];
    P out;
#pragma unroll
    for (int j = 0; j < P::n; ++j) {
      const float dn = round_to<T>(to_float(g.v[j]) * to_float(w.v[j]));
      out.v[j] = from_float<T>(r * (dn - to_float(p.v[j]) * r * mean_dot));
    }
    dxr[i] = out;
  }
}

// dweight[c] += sum over a slice of rows of dy[row, c] * to_T(x[row, c] * rstd[row]).
constexpr int kColumnsPerBlock = 64, kRowThreads = 4, kRowsPerSlice = 256;

template <typename T>
__global__ void rms_norm_backward_dw_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                            const float* __restrict__ rstd,
                                            float* __restrict__ dweight, int64_t rows, int dim) {
  __shared__ float partial[kRowThreads][kColumnsPerBlock];
  const int column = blockIdx.x * kColumnsPerBlock + threadIdx.x;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kRowsPerSlice;
  const int64_t last = first + kRowsPerSlice < rows ? first + kRowsPerSlice : rows;
  float sum = 0.f;
  if (column < dim) {
    for (int64_t row = first + threadIdx.y; row < last; row += kRowThreads) {
      const int64_t at = row * dim + column;
      sum += to_float(dy[at]) * round_to<T>(to_float(x[at]) * rstd[row]);
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && column < dim) {
    for (int k = 1; k < kRowThreads; ++k) sum += partial[k][threadIdx.x];
    atomicAdd(dweight + column, sum);
  }
}

// ------------------------------------------------------------------ rotary

// One item = one pack of the first half of a head vector and the matching
// pack of the second half. forward: a' = a cos - b sin, b' = b cos + a sin;
// backward (the transpose): a' = a cos + b sin, b' = b cos - a sin.
template <typename T>
__global__ void rotary_kernel(const T* __restrict__ x, const T* __restrict__ cos,
                              const T* __restrict__ sin, T* __restrict__ out, int64_t items,
                              int64_t seq, int64_t heads, int dim, float sign) {
  using P = Pack<T>;
  const int half = dim / 2, packs_per_half = half / P::n;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = item / packs_per_half;  // (batch, position, head)
    const int k = static_cast<int>(item % packs_per_half) * P::n;
    const int64_t position = (row / heads) % seq;
    const T* xr = x + row * dim;
    const T* cr = cos + position * dim;
    const T* sr = sin + position * dim;
    const P a = *reinterpret_cast<const P*>(xr + k), b = *reinterpret_cast<const P*>(xr + k + half);
    const P ca = *reinterpret_cast<const P*>(cr + k),
            cb = *reinterpret_cast<const P*>(cr + k + half);
    const P sa = *reinterpret_cast<const P*>(sr + k),
            sb = *reinterpret_cast<const P*>(sr + k + half);
    P oa, ob;
#pragma unroll
    for (int j = 0; j < P::n; ++j) {
      const float fa = to_float(a.v[j]), fb = to_float(b.v[j]);
      const float sin_a = sign > 0 ? to_float(sa.v[j]) : to_float(sb.v[j]);
      const float sin_b = sign > 0 ? to_float(sb.v[j]) : to_float(sa.v[j]);
      oa.v[j] = from_float<T>(fa * to_float(ca.v[j]) - sign * fb * sin_a);
      ob.v[j] = from_float<T>(fb * to_float(cb.v[j]) + sign * fa * sin_b);
    }
    *reinterpret_cast<P*>(out + row * dim + k) = oa;
    *reinterpret_cast<P*>(out + row * dim + k + half) = ob;
  }
}

// ------------------------------------------------------------------ SwiGLU

__device__ __forceinline__ float sigmoid(float v) {
  return 1.f / (1.f + __expf(-v));
}

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                      T* __restrict__ out, int64_t packs) {
  using P = Pack<T>;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const P g = reinterpret_cast<const P*>(gate)[i], u = reinterpret_cast<const P*>(up)[i];
    P o;
#pragma unroll
    for (int j = 0; j < P::n; ++j) {
      const float fg = to_float(g.v[j]);
      o.v[j] = from_float<T>(round_to<T>(fg * sigmoid(fg)) * to_float(u.v[j]));
    }
    reinterpret_cast<P*>(out)[i] = o;
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dout, const T* __restrict__ gate,
                                       const T* __restrict__ up, T* __restrict__ dgate,
                                       T* __restrict__ dup, int64_t packs) {
  using P = Pack<T>;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const P d = reinterpret_cast<const P*>(dout)[i], g = reinterpret_cast<const P*>(gate)[i],
            u = reinterpret_cast<const P*>(up)[i];
    P dg, du;
#pragma unroll
    for (int j = 0; j < P::n; ++j) {
      const float fd = to_float(d.v[j]), fg = to_float(g.v[j]), fu = to_float(u.v[j]);
      const float s = sigmoid(fg);
      du.v[j] = from_float<T>(fd * round_to<T>(fg * s));
      dg.v[j] = from_float<T>(round_to<T>(fd * fu) * s * (1.f + fg * (1.f - s)));
    }
    reinterpret_cast<P*>(dgate)[i] = dg;
    reinterpret_cast<P*>(dup)[i] = du;
  }
}

// ------------------------------------------------------------------ cross-entropy

constexpr int kLossThreads = 512;

// Running (max, sum of exp(v - max)) pairs, merged.
struct SoftmaxState {
  float max, sum;
};
__device__ __forceinline__ SoftmaxState merge(SoftmaxState a, SoftmaxState b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

// One block per row: the row's (max, sum) online, then its loss and, with
// write_grad, the row's gradient written over it.
template <typename T>
__global__ void cross_entropy_kernel(T* __restrict__ logits, const int64_t* __restrict__ labels,
                                     int64_t vocab, const float* __restrict__ scale,
                                     float* __restrict__ loss_sum, bool write_grad) {
  using P = Pack<T>;
  __shared__ SoftmaxState shared[kLossThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t label = labels[row];
  T* xr = logits + row * vocab;
  P* pr = reinterpret_cast<P*>(xr);
  const int64_t packs = vocab / P::n;
  if (label == -100) {  // ignored: no loss, zero gradient
    if (write_grad) {
      P zero;
#pragma unroll
      for (int j = 0; j < P::n; ++j) zero.v[j] = from_float<T>(0.f);
      for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) pr[i] = zero;
    }
    return;
  }
  SoftmaxState state{-INFINITY, 0.f};
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const P p = pr[i];
#pragma unroll
    for (int j = 0; j < P::n; ++j) state = merge(state, {to_float(p.v[j]), 1.f});
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const SoftmaxState other{__shfl_xor_sync(0xffffffffu, state.max, offset),
                             __shfl_xor_sync(0xffffffffu, state.sum, offset)};
    state = merge(state, other);
  }
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = state;
  __syncthreads();
  state = shared[0];
  for (int w = 1; w < kLossThreads / 32; ++w) state = merge(state, shared[w]);
  const bool in_range = label >= 0 && label < vocab;
  if (threadIdx.x == 0) {
    const float target = in_range ? to_float(xr[label]) : NAN;
    atomicAdd(loss_sum, logf(state.sum) + state.max - target);
  }
  if (!write_grad) return;
  __syncthreads();  // the target is read before the row is overwritten
  const float s = *scale, inv_sum = 1.f / state.sum;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    P p = pr[i];
#pragma unroll
    for (int j = 0; j < P::n; ++j) {
      const int64_t column = i * P::n + j;
      const float prob = __expf(to_float(p.v[j]) - state.max) * inv_sum;
      p.v[j] = from_float<T>((prob - (column == label ? 1.f : 0.f)) * s);
    }
    pr[i] = p;
  }
}

// ------------------------------------------------------------------ dispatch

template <typename F>
int with_type(DType dtype, F f) {
  switch (dtype) {
    case DType::kFloat:
      return f(float{});
    case DType::kHalf:
      return f(__half{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int rms_norm_forward(DType dtype, const void* x, const void* weight, void* y, float* rstd,
                     int64_t rows, int64_t dim, float eps, void* stream) {
  if (rows == 0) return 0;
  return with_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    rms_norm_forward_kernel<T><<<blocks, kRowsPerBlock * 32, 0, (cudaStream_t)stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<T*>(y), rstd, rows,
        static_cast<int>(dim), eps);
    return launched();
  });
}

int rms_norm_backward(DType dtype, const void* dy, const void* x, const void* weight,
                      const float* rstd, void* dx, float* dweight_accum, int64_t rows, int64_t dim,
                      void* stream) {
  if (rows == 0) return 0;
  return with_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    auto s = (cudaStream_t)stream;
    const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    rms_norm_backward_dx_kernel<T><<<blocks, kRowsPerBlock * 32, 0, s>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(weight), rstd,
        static_cast<T*>(dx), rows, static_cast<int>(dim));
    if (const int rc = launched()) return rc;
    const dim3 grid(static_cast<unsigned>((dim + kColumnsPerBlock - 1) / kColumnsPerBlock),
                    static_cast<unsigned>((rows + kRowsPerSlice - 1) / kRowsPerSlice));
    rms_norm_backward_dw_kernel<T><<<grid, dim3(kColumnsPerBlock, kRowThreads), 0, s>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), rstd, dweight_accum, rows,
        static_cast<int>(dim));
    return launched();
  });
}

int rotary(DType dtype, const void* x, const void* cos, const void* sin, void* out, int64_t batch,
           int64_t seq, int64_t heads, int64_t dim, bool backward, void* stream) {
  return with_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    const int64_t items = batch * seq * heads * (dim / 2 / Pack<T>::n);
    if (items == 0) return 0;
    rotary_kernel<T><<<blocks_for(items, 256), 256, 0, (cudaStream_t)stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
        static_cast<T*>(out), items, seq, heads, static_cast<int>(dim), backward ? -1.f : 1.f);
    return launched();
  });
}

int swiglu_forward(DType dtype, const void* gate, const void* up, void* out, int64_t n,
                   void* stream) {
  return with_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    const int64_t packs = n / Pack<T>::n;
    if (packs == 0) return 0;
    swiglu_forward_kernel<T><<<blocks_for(packs, 256), 256, 0, (cudaStream_t)stream>>>(
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), packs);
    return launched();
  });
}

int swiglu_backward(DType dtype, const void* dout, const void* gate, const void* up, void* dgate,
                    void* dup, int64_t n, void* stream) {
  return with_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    const int64_t packs = n / Pack<T>::n;
    if (packs == 0) return 0;
    swiglu_backward_kernel<T><<<blocks_for(packs, 256), 256, 0, (cudaStream_t)stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(gate), static_cast<const T*>(up),
        static_cast<T*>(dgate), static_cast<T*>(dup), packs);
    return launched();
  });
}

int cross_entropy(DType dtype, void* logits, const int64_t* labels, int64_t rows, int64_t vocab,
                  const float* scale, float* loss_sum, bool write_grad, void* stream) {
  if (rows == 0) return 0;
  return with_type(dtype, [&](auto zero) {
    using T = decltype(zero);
    cross_entropy_kernel<T><<<static_cast<unsigned>(rows), kLossThreads, 0, (cudaStream_t)stream>>>(
        static_cast<T*>(logits), labels, vocab, scale, loss_sum, write_grad);
    return launched();
  });
}

}  // namespace roundpipe::kernels

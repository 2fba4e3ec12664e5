// The 4-bit dequantization kernel: see quant_kernels.h and Note [4-bit base
// weights] (src/models/quantized.cpp). One thread a packed byte (two
// values); the block scale is decoded by each thread (a byte of codes and
// two loads, cached), with __fmul_rn / __fadd_rn so that no multiply-add is
// fused: the values are bitsandbytes', bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "quant_kernels.h"

namespace roundpipe::kernels {
namespace {

__constant__ float kNF4[16] = {-1.0f,
                               -0.6961928009986877f,
                               -0.5250730514526367f,
                               -0.39491748809814453f,
                               -0.28444138169288635f,
                               -0.18477343022823334f,
                               -0.09105003625154495f,
                               0.0f,
                               0.07958029955625534f,
                               0.16093020141124725f,
                               0.24611230194568634f,
                               0.33791524171829224f,
                               0.44070982933044434f,
                               0.5626170039176941f,
                               0.7229568362236023f,
                               1.0f};
// FP4: {0, 0.0625, 8, 12, 4, 6, 2, 3} / 12, bit 3 the sign (+0 at code 8).
__constant__ float kFP4[16] = {0.0f,          0.0625f / 12.0f,  8.0f / 12.0f,  1.0f,
                               4.0f / 12.0f,  6.0f / 12.0f,     2.0f / 12.0f,  3.0f / 12.0f,
                               0.0f,          -0.0625f / 12.0f, -8.0f / 12.0f, -1.0f,
                               -4.0f / 12.0f, -6.0f / 12.0f,    -2.0f / 12.0f, -3.0f / 12.0f};

template <typename T>
__device__ T store_as(float v);
template <>
__device__ float store_as<float>(float v) {
  return v;
}
template <>
__device__ __half store_as<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __nv_bfloat16 store_as<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float block_scale(int64_t block, const float* absmax,
                                             const uint8_t* codes, const float* nested_absmax,
                                             const float* nested_code, float offset) {
  if (absmax != nullptr) return absmax[block];
  return __fadd_rn(__fmul_rn(nested_code[codes[block]], nested_absmax[block / 256]), offset);
}

template <typename T>
__global__ void dequantize_4bit_kernel(bool nf4, const uint8_t* __restrict__ packed,
                                       const float* __restrict__ absmax,
                                       const uint8_t* __restrict__ codes,
                                       const float* __restrict__ nested_absmax,
                                       const float* __restrict__ nested_code, float offset,
                                       T* __restrict__ out, int64_t n, int64_t blocksize) {
  const int64_t byte = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t i = 2 * byte;
  if (i >= n) return;
  const float* table = nf4 ? kNF4 : kFP4;
  const uint8_t v = packed[byte];
  // (Blocks are even-sized, so both values of a byte share a block.)
  const float scale = block_scale(i / blocksize, absmax, codes, nested_absmax, nested_code, offset);
  out[i] = store_as<T>(__fmul_rn(table[v >> 4], scale));
  if (i + 1 < n) out[i + 1] = store_as<T>(__fmul_rn(table[v & 15], scale));
}

template <typename T>
int launch(bool nf4, const uint8_t* packed, const float* absmax, const uint8_t* codes,
           const float* nested_absmax, const float* nested_code, float offset, void* out, int64_t n,
           int64_t blocksize, void* stream) {
  constexpr int kThreads = 256;
  const int64_t bytes = (n + 1) / 2;
  const int64_t grid = (bytes + kThreads - 1) / kThreads;
  dequantize_4bit_kernel<T>
      <<<static_cast<unsigned>(grid), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          nf4, packed, absmax, codes, nested_absmax, nested_code, offset, static_cast<T*>(out), n,
          blocksize);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int dequantize_4bit(DType dtype, bool nf4, const uint8_t* packed, const float* absmax,
                    const uint8_t* absmax_codes, const float* nested_absmax,
                    const float* nested_code, float nested_offset, void* out, int64_t n,
                    int64_t blocksize, void* stream) {
  if (n <= 0) return 0;
  switch (dtype) {
    case DType::kFloat:
      return launch<float>(nf4, packed, absmax, absmax_codes, nested_absmax, nested_code,
                           nested_offset, out, n, blocksize, stream);
    case DType::kHalf:
      return launch<__half>(nf4, packed, absmax, absmax_codes, nested_absmax, nested_code,
                            nested_offset, out, n, blocksize, stream);
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(nf4, packed, absmax, absmax_codes, nested_absmax, nested_code,
                                   nested_offset, out, n, blocksize, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace roundpipe::kernels

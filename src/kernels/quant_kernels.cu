// The 4-bit dequantization kernel: see quant_kernels.h and Note [4-bit base
// weights] (src/models/quantized.cpp; the code table comes from there).
// One thread a packed byte (two values); each thread decodes its block's
// scale (a byte of codes and two loads, cached), with __fmul_rn / __fadd_rn
// so that no multiply-add is fused: the values are bitsandbytes', bit for
// bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "quant_kernels.h"

namespace roundpipe::kernels {
namespace {

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
                                             const float* nested_code, const float* offset) {
  if (absmax != nullptr) return absmax[block];
  return __fadd_rn(__fmul_rn(nested_code[codes[block]], nested_absmax[block / 256]), *offset);
}

template <typename T>
__global__ void dequantize_4bit_kernel(Code16 code, const uint8_t* __restrict__ packed,
                                       const float* __restrict__ absmax,
                                       const uint8_t* __restrict__ codes,
                                       const float* __restrict__ nested_absmax,
                                       const float* __restrict__ nested_code,
                                       const float* __restrict__ offset, T* __restrict__ out,
                                       int64_t n, int64_t blocksize) {
  const int64_t byte = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t i = 2 * byte;
  if (i >= n) return;
  const uint8_t v = packed[byte];
  // (Blocks are even-sized, so both values of a byte share a block.)
  const float scale = block_scale(i / blocksize, absmax, codes, nested_absmax, nested_code, offset);
  out[i] = store_as<T>(__fmul_rn(code.value[v >> 4], scale));
  if (i + 1 < n) out[i + 1] = store_as<T>(__fmul_rn(code.value[v & 15], scale));
}

template <typename T>
int launch(const Code16& code, const uint8_t* packed, const float* absmax, const uint8_t* codes,
           const float* nested_absmax, const float* nested_code, const float* offset, void* out,
           int64_t n, int64_t blocksize, void* stream) {
  constexpr int kThreads = 256;
  const int64_t bytes = (n + 1) / 2;
  const int64_t grid = (bytes + kThreads - 1) / kThreads;
  dequantize_4bit_kernel<T>
      <<<static_cast<unsigned>(grid), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          code, packed, absmax, codes, nested_absmax, nested_code, offset, static_cast<T*>(out), n,
          blocksize);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int dequantize_4bit(DType dtype, const Code16& code, const uint8_t* packed, const float* absmax,
                    const uint8_t* absmax_codes, const float* nested_absmax,
                    const float* nested_code, const float* nested_offset, void* out, int64_t n,
                    int64_t blocksize, void* stream) {
  if (n <= 0) return 0;
  switch (dtype) {
    case DType::kFloat:
      return launch<float>(code, packed, absmax, absmax_codes, nested_absmax, nested_code,
                           nested_offset, out, n, blocksize, stream);
    case DType::kHalf:
      return launch<__half>(code, packed, absmax, absmax_codes, nested_absmax, nested_code,
                            nested_offset, out, n, blocksize, stream);
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(code, packed, absmax, absmax_codes, nested_absmax, nested_code,
                                   nested_offset, out, n, blocksize, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace roundpipe::kernels

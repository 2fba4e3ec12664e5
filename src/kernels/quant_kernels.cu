// The dequantization kernels: 4-bit (below) and 8-bit (Note [8-bit weights,
// 16 a thread], further down). See quant_kernels.h and Note [4-bit base
// weights] (src/models/quantized.cpp; the code table comes from there).
// Each thread decodes its block's scale once (a byte of codes and two loads,
// cached), with __fmul_rn / __fadd_rn so that no multiply-add is fused: the
// values are bitsandbytes', bit for bit.
//
// Note [A wide thread a scale]: the kernel is bound by memory (half a byte
// read, two written, a value), so a thread reads 8 packed bytes in one load
// and writes its 16 values in 16-byte stores, and the 16-entry code table sits
// in shared memory: indexed by the data, a table in kernel parameter memory is
// read one distinct address at a time across a warp. The first kernel did one
// byte a thread from parameter memory and reached ~300 GB/s on an H200. The
// wide form needs 16 | blocksize (one scale a thread) and aligned pointers;
// otherwise, and for the last n % 16 values, a thread does one byte.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstring>

#include "quant_kernels.h"

namespace roundpipe::kernels {
namespace {

constexpr int kWideBytes = 8;  // packed bytes a wide thread reads: 16 values

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

// Two values rounded to T (2 bytes) as store_as does, the first at the lower
// address, as one word.
__device__ __forceinline__ uint32_t pack_two(__half, float a, float b) {
  const __half2 pair = __floats2half2_rn(a, b);
  uint32_t word;
  memcpy(&word, &pair, sizeof word);
  return word;
}
__device__ __forceinline__ uint32_t pack_two(__nv_bfloat16, float a, float b) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
  uint32_t word;
  memcpy(&word, &pair, sizeof word);
  return word;
}

// Stores 16 values, rounded to T as store_as does, at a 16-byte aligned out.
template <typename T>
__device__ __forceinline__ void store16(T* out, const float (&v)[16]) {
  if constexpr (sizeof(T) == 4) {
    float4* o = reinterpret_cast<float4*>(out);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  } else {
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = pack_two(T{}, v[2 * k], v[2 * k + 1]);
    uint4* o = reinterpret_cast<uint4*>(out);
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

__device__ __forceinline__ float block_scale(int64_t block, const float* absmax,
                                             const uint8_t* codes, const float* nested_absmax,
                                             const float* nested_code, const float* offset) {
  if (absmax != nullptr) return absmax[block];
  return __fadd_rn(__fmul_rn(nested_code[codes[block]], nested_absmax[block / 256]), *offset);
}

// Values [begin, n), kBytes packed bytes (2 kBytes values) a thread; begin
// is even (a multiple of 16 for the wide form).
template <typename T, int kBytes>
__global__ void dequantize_4bit_kernel(const __grid_constant__ Code16 code,
                                       const uint8_t* __restrict__ packed,
                                       const float* __restrict__ absmax,
                                       const uint8_t* __restrict__ codes,
                                       const float* __restrict__ nested_absmax,
                                       const float* __restrict__ nested_code,
                                       const float* __restrict__ offset, T* __restrict__ out,
                                       int64_t begin, int64_t n, int64_t blocksize) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = code.value[threadIdx.x];
  __syncthreads();
  const int64_t thread = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t i = begin + 2 * kBytes * thread;
  if (i >= n) return;
  // (Blocks are even-sized, so both values of a byte share a block; a wide
  // thread's 16 values share one as 16 divides the block size.)
  const float scale = block_scale(i / blocksize, absmax, codes, nested_absmax, nested_code, offset);
  if constexpr (kBytes == kWideBytes) {
    const uint64_t word = *reinterpret_cast<const uint64_t*>(packed + i / 2);
    float v[16];
#pragma unroll
    for (int k = 0; k < kWideBytes; ++k) {
      const unsigned byte = static_cast<unsigned>(word >> (8 * k)) & 0xffu;  // little-endian
      v[2 * k] = __fmul_rn(table[byte >> 4], scale);
      v[2 * k + 1] = __fmul_rn(table[byte & 15], scale);
    }
    store16<T>(out + i, v);
  } else {
    const uint8_t byte = packed[i / 2];
    out[i] = store_as<T>(__fmul_rn(table[byte >> 4], scale));
    if (i + 1 < n) out[i + 1] = store_as<T>(__fmul_rn(table[byte & 15], scale));
  }
}

template <typename T, int kBytes>
int launch_range(const Code16& code, const uint8_t* packed, const float* absmax,
                 const uint8_t* codes, const float* nested_absmax, const float* nested_code,
                 const float* offset, T* out, int64_t begin, int64_t n, int64_t blocksize,
                 cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t threads = (n - begin + 2 * kBytes - 1) / (2 * kBytes);
  if (threads <= 0) return 0;
  const int64_t grid = (threads + kThreads - 1) / kThreads;
  dequantize_4bit_kernel<T, kBytes><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      code, packed, absmax, codes, nested_absmax, nested_code, offset, out, begin, n, blocksize);
  return static_cast<int>(cudaGetLastError());
}

bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

template <typename T>
int launch(const Code16& code, const uint8_t* packed, const float* absmax, const uint8_t* codes,
           const float* nested_absmax, const float* nested_code, const float* offset, void* out,
           int64_t n, int64_t blocksize, void* stream) {
  T* values = static_cast<T*>(out);
  const auto s = static_cast<cudaStream_t>(stream);
  int64_t wide = 0;  // values the wide threads write
  if (blocksize % (2 * kWideBytes) == 0 && aligned(packed, kWideBytes) && aligned(values, 16)) {
    wide = n / (2 * kWideBytes) * (2 * kWideBytes);
    const int status =
        launch_range<T, kWideBytes>(code, packed, absmax, codes, nested_absmax, nested_code, offset,
                                    values, 0, wide, blocksize, s);
    if (status != 0) return status;
  }
  return launch_range<T, 1>(code, packed, absmax, codes, nested_absmax, nested_code, offset, values,
                            wide, n, blocksize, s);
}

// ---------------------------------------------------------------- 8-bit
// Note [8-bit weights, 16 a thread]: the same memory-bound shape as the
// 4-bit kernel (one byte read, two written, a value). The tensor-op form
// (values * scale * (1 / 127), then the cast) wrote and read float32
// intermediates twice: 349 GB/s of weight bytes on an H100. A wide thread
// reads 16 bytes of one row (16 | cols) in one load, and writes 16 values;
// the rest, one value a thread. __fmul_rn keeps the tensor ops' two
// roundings apart, so the values are theirs bit for bit.

template <EightBit kFormat>
__device__ __forceinline__ float decode8(unsigned byte) {
  if constexpr (kFormat == EightBit::kInt8) {
    return static_cast<float>(static_cast<int8_t>(byte));
  } else {
    __nv_fp8_e4m3 v;
    v.__x = static_cast<__nv_fp8_storage_t>(byte);
    return static_cast<float>(v);  // exact: every e4m3 value is a float
  }
}

template <EightBit kFormat>
__device__ __forceinline__ float scaled8(unsigned byte, float scale, float inverse) {
  const float x = __fmul_rn(decode8<kFormat>(byte), scale);
  return kFormat == EightBit::kInt8 ? __fmul_rn(x, inverse) : x;
}

template <typename T, EightBit kFormat, bool kWide>
__global__ void dequantize_8bit_kernel(const uint8_t* __restrict__ values,
                                       const float* __restrict__ scale, float inverse,
                                       T* __restrict__ out, int64_t begin, int64_t n,
                                       int64_t cols) {
  const int64_t thread = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t i = begin + (kWide ? 16 : 1) * thread;
  if (i >= n) return;
  const float s = scale[i / cols];  // a wide thread's 16 values share a row: 16 | cols
  if constexpr (kWide) {
    const uint4 word = *reinterpret_cast<const uint4*>(values + i);
    const uint32_t w[4] = {word.x, word.y, word.z, word.w};
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k)
      v[k] = scaled8<kFormat>((w[k / 4] >> (8 * (k % 4))) & 0xffu, s, inverse);  // little-endian
    store16<T>(out + i, v);
  } else {
    out[i] = store_as<T>(scaled8<kFormat>(values[i], s, inverse));
  }
}

template <typename T, EightBit kFormat, bool kWide>
int launch_8bit_range(const uint8_t* values, const float* scale, float inverse, T* out,
                      int64_t begin, int64_t n, int64_t cols, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t threads = (n - begin + (kWide ? 15 : 0)) / (kWide ? 16 : 1);
  if (threads <= 0) return 0;
  const int64_t grid = (threads + kThreads - 1) / kThreads;
  dequantize_8bit_kernel<T, kFormat, kWide><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      values, scale, inverse, out, begin, n, cols);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, EightBit kFormat>
int launch_8bit(const uint8_t* values, const float* scale, float inverse, void* out, int64_t rows,
                int64_t cols, void* stream) {
  T* o = static_cast<T*>(out);
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t n = rows * cols;
  int64_t wide = 0;  // values the wide threads write
  if (cols % 16 == 0 && aligned(values, 16) && aligned(o, 16)) {
    wide = n;
    const int status =
        launch_8bit_range<T, kFormat, true>(values, scale, inverse, o, 0, n, cols, s);
    if (status != 0) return status;
  }
  return launch_8bit_range<T, kFormat, false>(values, scale, inverse, o, wide, n, cols, s);
}

template <typename T>
int launch_8bit(EightBit format, const uint8_t* values, const float* scale, float inverse,
                void* out, int64_t rows, int64_t cols, void* stream) {
  return format == EightBit::kInt8
             ? launch_8bit<T, EightBit::kInt8>(values, scale, inverse, out, rows, cols, stream)
             : launch_8bit<T, EightBit::kE4M3>(values, scale, inverse, out, rows, cols, stream);
}

}  // namespace

int dequantize_8bit(DType dtype, EightBit format, const uint8_t* values, const float* scale,
                    float inverse, void* out, int64_t rows, int64_t cols, void* stream) {
  if (rows <= 0 || cols <= 0) return 0;
  switch (dtype) {
    case DType::kFloat:
      return launch_8bit<float>(format, values, scale, inverse, out, rows, cols, stream);
    case DType::kHalf:
      return launch_8bit<__half>(format, values, scale, inverse, out, rows, cols, stream);
    case DType::kBFloat16:
      return launch_8bit<__nv_bfloat16>(format, values, scale, inverse, out, rows, cols, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

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

// Launchers of the 4-bit and 8-bit dequantization kernels (quant_kernels.cu), plain C++
// as fused_kernels.h: raw pointers, a stream, a cudaError_t back.
#pragma once

#include <cstdint>

#include "fused_kernels.h"

namespace roundpipe::kernels {

// The 16 values of a 4-bit code (passed by value: kernel parameter memory).
struct Code16 {
  float value[16];
};

// out[i] = code[q_i] * absmax[i / blocksize] in float, stored as `dtype`,
// for n values packed two a byte (the even one in the high nibble). The block scales are absmax
// (float), or absmax_codes (uint8) decoded as nested_code[c] * nested_absmax[b / 256]
// + *nested_offset (Note [4-bit base weights]).
int dequantize_4bit(DType dtype, const Code16& code, const uint8_t* packed, const float* absmax,
                    const uint8_t* absmax_codes, const float* nested_absmax,
                    const float* nested_code, const float* nested_offset, void* out, int64_t n,
                    int64_t blocksize, void* stream);

// The 8-bit formats (Note [8-bit base weights], src/models/quantized_8bit.cpp).
enum class EightBit { kInt8, kE4M3 };

// out[r, c] = float(values[r, c]) * scale[r], then for int8 times `inverse`
// (bitsandbytes' 1 / 127) as a second rounding, in float, stored as `dtype`;
// values are rows x cols bytes (int8, or e4m3 bit patterns), row-major.
int dequantize_8bit(DType dtype, EightBit format, const uint8_t* values, const float* scale,
                    float inverse, void* out, int64_t rows, int64_t cols, void* stream);

}  // namespace roundpipe::kernels

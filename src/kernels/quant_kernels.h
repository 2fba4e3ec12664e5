// Launchers of the 4-bit dequantization kernel (quant_kernels.cu), plain C++
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

}  // namespace roundpipe::kernels

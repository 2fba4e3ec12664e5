// The Adam inner loop over one contiguous chunk, for every combination the
// optimizer needs. Internal header.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace roundpipe::optim::kernel {

// A gradient element as float (the kernels' inputs are fp32, fp16 or bf16).
inline float to_float(float x) {
  return x;
}
inline float to_float(c10::Half x) {
  return static_cast<float>(x);
}
inline float to_float(c10::BFloat16 x) {
  return static_cast<float>(x);
}

// Per-tensor scalars, all as the float values torch's composition uses.
struct AdamScalars {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float l2_decay;        // weight_decay for Adam, 0 for AdamW
  float decoupled_keep;  // 1 - lr * weight_decay for AdamW, 1 for Adam
  float grad_sign;       // -1 with maximize, times the gradient multiplier
  float sqrt_bias_correction2;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

// grad: fp32, fp16 or bf16; low_precision_out: null, or the weight to write
// in the gradient's low-precision type.
void adam_f32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
              float* max_exp_avg_sq, int64_t n, const AdamScalars& s);
void adam_f16(float* param, const c10::Half* grad, float* exp_avg, float* exp_avg_sq,
              float* max_exp_avg_sq, c10::Half* out, int64_t n, const AdamScalars& s);
void adam_bf16(float* param, const c10::BFloat16* grad, float* exp_avg, float* exp_avg_sq,
               float* max_exp_avg_sq, c10::BFloat16* out, int64_t n, const AdamScalars& s);

// Blockwise 8-bit moments (bitsandbytes' layout): exp_avg as codes of the
// signed dynamic map, exp_avg_sq of the unsigned one, each with one absmax
// per kQuantBlock elements. The pointers start at a block boundary.
struct QuantizedMoments {
  uint8_t* exp_avg;
  float* exp_avg_absmax;
  uint8_t* exp_avg_sq;
  float* exp_avg_sq_absmax;
};

// The update of Adam8bit: the moments of each block are decoded, updated
// as adam_f32's are, used for the parameter's step, and stored again as the
// nearest codes under the block's new absmax. No amsgrad.
void adam8bit_f32(float* param, const float* grad, const QuantizedMoments& q, int64_t n,
                  const AdamScalars& s);
void adam8bit_f16(float* param, const c10::Half* grad, const QuantizedMoments& q, c10::Half* out,
                  int64_t n, const AdamScalars& s);
void adam8bit_bf16(float* param, const c10::BFloat16* grad, const QuantizedMoments& q,
                   c10::BFloat16* out, int64_t n, const AdamScalars& s);

// The sum of the squares of g[0..n), each partial sum in float (the
// gradient norm of clipping).
double sum_of_squares(const float* g, int64_t n);
double sum_of_squares(const c10::Half* g, int64_t n);
double sum_of_squares(const c10::BFloat16* g, int64_t n);

// Which instruction set the loaded clones run with.
const char* adam_kernel_isa();

}  // namespace roundpipe::optim::kernel

// The elementwise building blocks of the model presets. On CUDA tensors they
// run fused kernels (one pass each, forward and backward, see
// src/kernels/fused_kernels.cu); elsewhere (CPU, the simulated backend) and
// for shapes the kernels do not take, the plain LibTorch compositions below,
// which follow HuggingFace transformers operation by operation. Setting
// ROUNDPIPE_FUSED_KERNELS=0 forces the plain path everywhere (to compare).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace roundpipe::models::ops {

// Whether the fused kernels serve tensors like x (a CUDA tensor of float,
// half or bfloat16, the kernels compiled in and not switched off).
bool fused_available(const at::Tensor& x);

// weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over the last dimension.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// Rotary embedding of x [batch, seq, heads, head_dim] with cos/sin
// [seq, head_dim] (or [1, seq, head_dim]): x * cos + rotate_half(x) * sin.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// silu(gate) * up.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// (x * scale).to(dtype) for x of one or more dimensions and a 0-dim scale,
// the same values, made a block of rows (about block_bytes of x) at a time
// into the result: the product in x's dtype never exists whole beside it.
// The fused loss's backward scales its float32 weight gradient so, which
// whole would take another 1.45 GiB at Qwen3-4B's vocabulary.
at::Tensor scaled_to(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype,
                     int64_t block_bytes = int64_t{64} << 20);

// The plain compositions: the CPU path and the fused kernels' test oracle.
namespace plain {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);
}  // namespace plain

}  // namespace roundpipe::models::ops

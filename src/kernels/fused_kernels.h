// Launchers of the fused CUDA kernels of the model presets (fused_kernels.cu).
// Plain C++ on purpose: the .cu file includes no ATen header (fast to build),
// and src/models/fused_ops.cpp wraps these in autograd functions.
//
// Every launcher takes contiguous buffers of the given element type, 16-byte
// aligned, whose row length is a multiple of 16 bytes (the caller checks;
// see fused::supports), runs on `stream` (a cudaStream_t) and returns a
// cudaError_t value (0 = success).
#pragma once

#include <cstdint>

namespace roundpipe::kernels {

enum class DType { kFloat, kHalf, kBFloat16 };

// y = weight * to_dtype(x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) per row
// (HuggingFace's order of rounding); rstd (float[rows]) kept for backward.
int rms_norm_forward(DType dtype, const void* x, const void* weight, void* y, float* rstd,
                     int64_t rows, int64_t dim, float eps, void* stream);
// dx from dy; dweight_accum (float[dim], zeroed by the caller) += the
// weight's gradient summed over rows.
int rms_norm_backward(DType dtype, const void* dy, const void* x, const void* weight,
                      const float* rstd, void* dx, float* dweight_accum, int64_t rows, int64_t dim,
                      void* stream);

// Rotary embedding of x [batch, seq, heads, dim] with cos/sin [seq, dim]:
// out = x * cos + rotate_half(x) * sin; backward = true applies the
// transpose (the gradient of x from the gradient of out).
int rotary(DType dtype, const void* x, const void* cos, const void* sin, void* out, int64_t batch,
           int64_t seq, int64_t heads, int64_t dim, bool backward, void* stream);

// out = silu(gate) * up over n elements, and its backward.
int swiglu_forward(DType dtype, const void* gate, const void* up, void* out, int64_t n,
                   void* stream);
int swiglu_backward(DType dtype, const void* dout, const void* gate, const void* up, void* dgate,
                    void* dup, int64_t n, void* stream);

// Cross-entropy of logits [rows, vocab] against labels (int64, -100 =
// ignored): loss_sum (float scalar) += sum of row losses. With write_grad,
// the logits are overwritten by d(loss_sum * scale)/d(logits) =
// (softmax - onehot) * scale (ignored rows: 0), scale read from a device
// float. A label outside [0, vocab) makes the loss NaN.
int cross_entropy(DType dtype, void* logits, const int64_t* labels, int64_t rows, int64_t vocab,
                  const float* scale, float* loss_sum, bool write_grad, void* stream);

}  // namespace roundpipe::kernels

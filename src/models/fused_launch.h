// What the autograd wrappers of the fused kernels share: the kernel's
// element type, the current stream and the launch check. CUDA builds only.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/fused_kernels.h"

namespace roundpipe::models::ops {

inline kernels::DType kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return kernels::DType::kFloat;
    case at::kHalf:
      return kernels::DType::kHalf;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "the fused kernels take float, half or bfloat16 tensors, got ",
                  t.scalar_type());
  }
}

inline void* current_stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

inline void check_launch(int rc) {
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
}

}  // namespace roundpipe::models::ops

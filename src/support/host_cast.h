// Large host casts between float32 and float16/bfloat16 that write past the
// cache: the optimizer's per-step passes over every trainable parameter
// (Note [Casts that bypass the cache], host_cast.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace roundpipe {

// dst.copy_(src), the same values bit for bit (a NaN stays a NaN), for CPU
// tensors of one size. Between float32 and float16 or bfloat16 (either
// way), both contiguous and dst at least 4 MiB, on a CPU with AVX2 and F16C:
// converted in 16-byte pieces on the optimizer's thread pool and stored with
// streaming stores. Otherwise (other dtypes, strides, small tensors, other
// CPUs) it is dst.copy_(src). Like copy_, it counts as an in-place write of
// dst (its version goes up).
void cast_copy(const at::Tensor& dst, const at::Tensor& src);

// Whether cast_copy(dst, src) takes the streaming path (for tests).
bool cast_copy_streams(const at::Tensor& dst, const at::Tensor& src);

}  // namespace roundpipe

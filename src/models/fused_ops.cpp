// Autograd functions over the fused CUDA kernels, and the plain compositions
// they replace.
#include "roundpipe/models/fused_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#ifdef ROUNDPIPE_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/fused_kernels.h"
#include "models/fused_launch.h"
#endif

namespace roundpipe::models::ops {

namespace plain {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  auto h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(dtype);
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // cos/sin [seq, dim] (or one table per row, [batch, seq, dim]) broadcast
  // over the heads (and rows) of [batch, seq, heads, dim].
  const int64_t rows = cos.numel() == x.size(1) * x.size(3) ? 1 : x.size(0);
  const auto c = cos.reshape({rows, x.size(1), 1, x.size(3)});
  const auto s = sin.reshape({rows, x.size(1), 1, x.size(3)});
  auto halves = x.chunk(2, -1);
  return x * c + at::cat({-halves[1], halves[0]}, -1) * s;
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(gate) * up;
}

}  // namespace plain

at::Tensor scaled_to(const at::Tensor& x, const at::Tensor& scale, at::ScalarType dtype,
                     int64_t block_bytes) {
  TORCH_CHECK(x.dim() >= 1 && scale.dim() == 0,
              "scaled_to: x needs one or more dimensions and scale none");
  // (out= has no autograd: a product that must carry a graph, as in a
  // backward with create_graph, is the plain expression.)
  const bool graph = c10::GradMode::is_enabled() && (x.requires_grad() || scale.requires_grad());
  if (dtype == x.scalar_type() || x.size(0) == 0 || graph) return (x * scale).to(dtype);
  auto out = at::empty(x.sizes(), x.options().dtype(dtype));
  const int64_t rows = x.size(0);
  const int64_t row_bytes = std::max<int64_t>(x.numel() / rows * x.element_size(), 1);
  const int64_t block = std::max<int64_t>(block_bytes / row_bytes, 1);
  for (int64_t r = 0; r < rows; r += block) {
    const int64_t len = std::min(block, rows - r);
    // (On CUDA the product is cast as it is stored; on CPU through a
    // block-sized temporary.)
    auto rows_out = out.narrow(0, r, len);
    at::mul_out(rows_out, x.narrow(0, r, len), scale);
  }
  return out;
}

#ifdef ROUNDPIPE_WITH_CUDA
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether t can be handed to a kernel as is: contiguous, 16-byte aligned,
// rows of whole 16-byte packs (and, for rotary, half rows).
bool packable(const at::Tensor& t, int64_t row_elements) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
         (row_elements * static_cast<int64_t>(t.element_size())) % 16 == 0;
}

struct RMSNormFunction : torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    auto y = at::empty_like(x);
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    check_launch(kernels::rms_norm_forward(kernel_dtype(x), x.data_ptr(), weight.data_ptr(),
                                           y.data_ptr(), rstd.data_ptr<float>(), rows, dim,
                                           static_cast<float>(eps), current_stream()));
    ctx->save_for_backward({x, weight, rstd});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const auto dy = grads[0].contiguous();
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    auto dx = at::empty_like(x);
    auto dweight = at::zeros({dim}, x.options().dtype(at::kFloat));
    check_launch(kernels::rms_norm_backward(
        kernel_dtype(x), dy.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr<float>(),
        dx.data_ptr(), dweight.data_ptr<float>(), rows, dim, current_stream()));
    return {dx, dweight.to(weight.scalar_type()), at::Tensor()};
  }
};

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static at::Tensor apply_kernel(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 bool backward) {
    auto out = at::empty_like(x);
    check_launch(kernels::rotary(kernel_dtype(x), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 out.data_ptr(), x.size(0), x.size(1), x.size(2), x.size(3),
                                 backward, current_stream()));
    return out;
  }
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return apply_kernel(x, cos, sin, /*backward=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {apply_kernel(grads[0].contiguous(), saved[0], saved[1], /*backward=*/true),
            at::Tensor(), at::Tensor()};
  }
};

struct SwiGLUFunction : torch::autograd::Function<SwiGLUFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    auto out = at::empty_like(gate);
    check_launch(kernels::swiglu_forward(kernel_dtype(gate), gate.data_ptr(), up.data_ptr(),
                                         out.data_ptr(), gate.numel(), current_stream()));
    ctx->save_for_backward({gate, up});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &gate = saved[0], &up = saved[1];
    const auto dout = grads[0].contiguous();
    auto dgate = at::empty_like(gate), dup = at::empty_like(up);
    check_launch(kernels::swiglu_backward(kernel_dtype(gate), dout.data_ptr(), gate.data_ptr(),
                                          up.data_ptr(), dgate.data_ptr(), dup.data_ptr(),
                                          gate.numel(), current_stream()));
    return {dgate, dup};
  }
};

}  // namespace

bool fused_available(const at::Tensor& x) {
  static const bool enabled = [] {
    const char* v = std::getenv("ROUNDPIPE_FUSED_KERNELS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  const auto t = x.scalar_type();
  return enabled && x.is_cuda() && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t dim = x.size(-1);
  if (fused_available(x) && weight.scalar_type() == x.scalar_type() && weight.numel() == dim) {
    auto xc = x.contiguous();
    auto wc = weight.contiguous();
    if (packable(xc, dim) && packable(wc, dim)) return RMSNormFunction::apply(xc, wc, eps);
  }
  return plain::rms_norm(x, weight, eps);
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // One table per row (position_ids): the kernel indexes its table by
  // position within the sequence, so fold the rows into one long sequence.
  if (x.dim() == 4 && x.size(0) > 1 && cos.numel() == x.numel() / x.size(2)) {
    const auto sizes = x.sizes();
    return rotary(x.reshape({1, sizes[0] * sizes[1], sizes[2], sizes[3]}), cos, sin).view(sizes);
  }
  if (fused_available(x) && x.dim() == 4 && cos.scalar_type() == x.scalar_type() &&
      sin.scalar_type() == x.scalar_type() && cos.numel() == x.size(1) * x.size(3) &&
      sin.numel() == cos.numel() && x.size(3) % 2 == 0) {
    auto xc = x.contiguous();
    auto cc = cos.contiguous(), sc = sin.contiguous();
    const int64_t half = x.size(3) / 2;
    if (packable(xc, half) && packable(cc, half) && packable(sc, half))
      return RotaryFunction::apply(xc, cc, sc);
  }
  return plain::rotary(x, cos, sin);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (fused_available(gate) && up.scalar_type() == gate.scalar_type() &&
      up.sizes() == gate.sizes()) {
    auto g = gate.contiguous(), u = up.contiguous();
    if (packable(g, g.numel()) && packable(u, u.numel())) return SwiGLUFunction::apply(g, u);
  }
  return plain::swiglu(gate, up);
}

#else  // no CUDA backend: the plain compositions serve everything

bool fused_available(const at::Tensor&) {
  return false;
}
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return plain::rms_norm(x, weight, eps);
}
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return plain::rotary(x, cos, sin);
}
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return plain::swiglu(gate, up);
}

#endif

}  // namespace roundpipe::models::ops

// A projection over a frozen quantized base weight that autograd can
// differentiate without keeping the dequantized weight: Note [Dequantized
// weights are not kept].
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "models/quantized_weight.h"

namespace roundpipe::models::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Note [Dequantized weights are not kept]
// A projection on a quantized base dequantizes its weight, then multiplies.
// Left to autograd, at::linear saves that dequantized weight for the input's
// gradient: the full-precision bytes of every projection, for as long as the
// backward is pending. At Qwen3-32B that is 0.93 GiB a decoder layer, and a
// region with grad over k layers (a stage-grain backward stage, a fused tail
// of grad layers, each of its row chunks) keeps k of them; in a 32B tail of
// 8 grad layers run in 8 row chunks, 5.9 GiB of dequantized MLP weights
// alone, which ran a 24 GiB card out of memory. Here the function keeps the
// packed weight instead (a parameter the device holds anyway: no bytes
// more) and dequantizes it again in the backward, as bitsandbytes' 4-bit
// matmul does: one more dequantization a projection and backward (~1.2 ms
// for a 5120 x 25600 weight on an H100) against its matmuls. The weight is
// frozen, so the backward computes the input's gradient only.
struct QuantizedLinearFunction : torch::autograd::Function<QuantizedLinearFunction> {
  // The weight's tensors (undefined where its format has none), by the names
  // the context keeps them under.
  static constexpr std::pair<const char*, at::Tensor QuantizedWeight::*> kParts[] = {
      {"codes", &QuantizedWeight::codes},
      {"absmax", &QuantizedWeight::absmax},
      {"nested_absmax", &QuantizedWeight::nested_absmax},
      {"nested_code", &QuantizedWeight::nested_code},
      {"nested_offset", &QuantizedWeight::nested_offset},
      {"scale", &QuantizedWeight::scale}};
  // (An absent bias is an empty tensor: custom functions take no undefined
  // inputs.)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias,
                            const QuantizedWeight& weight) {
    auto& saved = ctx->saved_data;
    saved["type"] = static_cast<int64_t>(weight.quant.type);
    saved["double_quant"] = weight.quant.double_quant;
    saved["shape"] = weight.shape;
    for (const auto& [name, part] : kParts) saved[name] = weight.*part;
    return at::linear(x, weight.dequantize(x.scalar_type()),
                      bias.numel() > 0 ? bias : at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& saved = ctx->saved_data;
    QuantizedWeight weight(BaseQuantization{static_cast<QuantType>(saved["type"].toInt()),
                                            saved["double_quant"].toBool()},
                           saved["shape"].toIntVector());
    for (const auto& [name, part] : kParts) weight.*part = saved[name].toTensor();
    const auto& grad = grads[0];
    // y = x W^T + b, so dL/dx = dL/dy W and dL/db sums dL/dy over the rows.
    at::Tensor grad_bias;
    if (ctx->needs_input_grad(1)) grad_bias = grad.reshape({-1, grad.size(-1)}).sum(0);
    return {at::matmul(grad, weight.dequantize(grad.scalar_type())), grad_bias, at::Tensor()};
  }
};

}  // namespace

at::Tensor quantized_linear(const at::Tensor& x, const QuantizedWeight& weight,
                            const at::Tensor& bias) {
  const bool grad =
      at::GradMode::is_enabled() && (x.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (!grad) return at::linear(x, weight.dequantize(x.scalar_type()), bias);
  return QuantizedLinearFunction::apply(x, bias.defined() ? bias : at::empty({0}, x.options()),
                                        weight);
}

}  // namespace roundpipe::models::detail

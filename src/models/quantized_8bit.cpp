// 8-bit base weights: see include/roundpipe/models/quantized.h.
//
// Note [8-bit base weights]
// Two formats, each with one float32 scale a row (an output channel):
//   - int8 is bitsandbytes' LLM.int8 weight, as transformers' load_in_8bit
//     makes it (Int8Params: CB and SCB): the weight in float16, each row
//     times 127 / its absolute maximum, rounded half to even. Dequantized
//     as bitsandbytes does (values * SCB * (1 / 127), float32), so a model
//     loaded with load_in_8bit wraps with its values bit for bit. What
//     differs is the product: bitsandbytes multiplies int8 weights by int8
//     activations (each row of the input rounded to 8 bits, outlier columns
//     in float16); we multiply the dequantized weight by the input as it is
//     (weight-only quantization), which rounds less.
//   - fp8 is e4m3 (3 mantissa bits, largest 448), each row scaled to fill
//     it: a relative rounding error of at most 2^-4, against 1/254 of the
//     row's maximum (absolute) for int8.
// Both halve the host memory and PCIe bytes of bf16 (plus 4 bytes a row).
// Dequantization runs as tensor operations on the CPU (the simulated
// devices), and as one kernel on a CUDA GPU, with the tensor operations'
// roundings (Note [8-bit weights, 16 a thread], src/kernels/quant_kernels.cu).
#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/round.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include "roundpipe/models/quantized.h"

#ifdef ROUNDPIPE_WITH_CUDA
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/quant_kernels.h"
#include "models/fused_launch.h"
#endif

namespace roundpipe::models {
namespace {

constexpr double kInt8Max = 127.0;
constexpr double kFP8Max = 448.0;  // e4m3fn's largest finite value
// bitsandbytes' 1 / 127, as it writes it (a double, rounded to the
// tensor's float32 where it multiplies).
constexpr double kInverseInt8Max = 7.874015718698502e-3;

}  // namespace

Quantized8Bit quantize_8bit(const at::Tensor& weight, QuantType type) {
  TORCH_CHECK_VALUE(!is_4bit(type), "quantize_8bit takes int8 or fp8, not ", to_string(type),
                    " (quantize_4bit makes those)");
  TORCH_CHECK_VALUE(
      weight.device().is_cpu() && weight.dim() == 2 && at::isFloatingType(weight.scalar_type()),
      "quantize_8bit takes a 2-D float CPU tensor [rows, cols], got ", weight.scalar_type(), " ",
      weight.sizes(), " on ", weight.device());
  Quantized8Bit q;
  q.type = type;
  q.dtype = weight.scalar_type();
  if (type == QuantType::kInt8) {
    // bitsandbytes quantizes the float16 weight (Int8Params._quantize).
    const auto w = weight.to(at::kHalf).to(at::kFloat);
    q.scale = at::amax(at::abs(w), {1});
    const auto values = at::round(w * (q.scale.reciprocal() * kInt8Max).unsqueeze(1));
    // (A row of zeros: 0 * inf; its codes are 0.)
    q.values = at::where(q.scale.unsqueeze(1) > 0, values, 0).to(at::kChar);
  } else {
    const auto w = weight.to(at::kFloat);
    const auto amax = at::amax(at::abs(w), {1});
    q.scale = at::where(amax > 0, amax / kFP8Max, at::ones_like(amax));
    q.values = (w / q.scale.unsqueeze(1)).to(at::kFloat8_e4m3fn).view(at::kByte);
  }
  return q;
}

at::Tensor dequantize_8bit(const Quantized8Bit& q) {
  const bool int8 = q.type == QuantType::kInt8;
  TORCH_CHECK_VALUE(!is_4bit(q.type), "dequantize_8bit takes int8 or fp8, not ", to_string(q.type));
  TORCH_CHECK_VALUE(q.values.dim() == 2 && q.values.scalar_type() == (int8 ? at::kChar : at::kByte),
                    "an ", to_string(q.type), " weight needs ",
                    int8 ? "int8" : "uint8 (e4m3 bytes)", " values [rows, cols], got ",
                    q.values.scalar_type(), " ", q.values.sizes());
  TORCH_CHECK_VALUE(q.scale.scalar_type() == at::kFloat && q.scale.numel() == q.values.size(0),
                    "an 8-bit weight of ", q.values.size(0),
                    " rows needs as many float32 scales, got ", q.scale.scalar_type(), " ",
                    q.scale.sizes());
  TORCH_CHECK_VALUE(q.scale.device() == q.values.device(), "an 8-bit weight's scales are on ",
                    q.scale.device(), ", its values on ", q.values.device(),
                    ": move both to one device");
#ifdef ROUNDPIPE_WITH_CUDA
  const bool kernel_dtype =
      q.dtype == at::kFloat || q.dtype == at::kHalf || q.dtype == at::kBFloat16;
  if (q.values.is_cuda() && kernel_dtype && q.values.is_contiguous() && q.scale.is_contiguous()) {
    const c10::cuda::CUDAGuard guard(q.values.device());
    auto out = at::empty(q.values.sizes(), q.values.options().dtype(q.dtype));
    ops::check_launch(kernels::dequantize_8bit(
        ops::kernel_dtype(out), int8 ? kernels::EightBit::kInt8 : kernels::EightBit::kE4M3,
        static_cast<const uint8_t*>(q.values.const_data_ptr()), q.scale.const_data_ptr<float>(),
        static_cast<float>(kInverseInt8Max), out.mutable_data_ptr(), q.values.size(0),
        q.values.size(1), ops::current_stream()));
    return out;
  }
#endif
  const auto scale = q.scale.view({-1, 1});
  if (int8) return (q.values * scale * kInverseInt8Max).to(q.dtype);
  return (q.values.view(at::kFloat8_e4m3fn).to(at::kFloat) * scale).to(q.dtype);
}

}  // namespace roundpipe::models

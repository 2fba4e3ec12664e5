// 4-bit base weights: see include/roundpipe/models/quantized.h.
//
// Note [4-bit base weights]
// QLoRA (Dettmers et al. 2023) keeps a frozen base model in 4 bits and
// trains LoRA adapters in 16. We keep bitsandbytes' layout so that its
// checkpoints (and models transformers loads with load_in_4bit) are used
// as they are:
//   - the weight, flattened row-major, in blocks of `blocksize` (64) values;
//     each value times 1 / its block's absolute maximum (float32), rounded to
//     the nearest of 16 codes (NF4's normal quantiles, or FP4), a tie to the
//     lower code; two codes a byte, the even element's in the high nibble;
//   - double quantization: the block maxima less their mean (`offset`) in
//     8 bits, blocks of 256 scaled by their own maximum, the nearest value of
//     the signed dynamic map (a tie to the even index, as bitsandbytes'
//     CUDA kernel);
//   - dequantization: absmax = code2[q] * absmax2 then + offset, and the
//     value code[q] * absmax, each a float32 operation (no fused
//     multiply-add), rounded once to the weight's dtype.
// So dequantizing gives bitsandbytes' values bit for bit; quantizing gives
// its codes except where bitsandbytes' own CPU and CUDA paths disagree
// (an 8-bit scale within rounding of a midpoint; a block of zeros; FP4's
// sign of values under 0.0026 of the block's maximum, which decode to 0
// either way). Host memory and upload bytes per weight: n / 2 + n / 64
// (+ n / 16384 * 4) against 2n in bf16, 3.9x less.
#include "roundpipe/models/quantized.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linspace.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "support/parallel.h"

#ifdef ROUNDPIPE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "kernels/quant_kernels.h"
#include "models/fused_launch.h"
#endif

namespace roundpipe::models {
namespace {

constexpr int64_t kNestedBlock = 256;

// NF4: bitsandbytes' table (the QLoRA paper's normal quantiles, 8 positive
// and 7 negative, and an exact 0).
constexpr std::array<float, 16> kNF4 = {-1.0f,
                                        -0.6961928009986877f,
                                        -0.5250730514526367f,
                                        -0.39491748809814453f,
                                        -0.28444138169288635f,
                                        -0.18477343022823334f,
                                        -0.09105003625154495f,
                                        0.0f,
                                        0.07958029955625534f,
                                        0.16093020141124725f,
                                        0.24611230194568634f,
                                        0.33791524171829224f,
                                        0.44070982933044434f,
                                        0.5626170039176941f,
                                        0.7229568362236023f,
                                        1.0f};
// FP4 (e2m1 as bitsandbytes encodes it): magnitudes {0, 0.0625, 8, 12, 4,
// 6, 2, 3} / 12 by the low three bits, bit 3 the sign.
std::array<float, 16> fp4_table() {
  constexpr std::array<float, 8> raw = {0.0f, 0.0625f, 8.0f, 12.0f, 4.0f, 6.0f, 2.0f, 3.0f};
  std::array<float, 16> out{};
  for (int i = 0; i < 8; ++i) {
    out[i] = raw[i] / 12.0f;
    out[i + 8] = -out[i];
  }
  out[8] = 0.0f;  // (bitsandbytes stores +0 at the negative zero's code)
  return out;
}

const std::array<float, 16>& table_of(QuantType type) {
  TORCH_CHECK_VALUE(is_4bit(type), to_string(type), " is not a 4-bit type: use nf4 or fp4");
  static const std::array<float, 16> fp4 = fp4_table();
  return type == QuantType::kNF4 ? kNF4 : fp4;
}

// bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7,
// total_bits=8): for i in 0..6, the midpoints of linspace(0.1, 1, 2^i + 1)
// times 10^(i - 6), both signs, then 0 and 1, sorted, in float32 torch ops
// as bitsandbytes makes it (torch's float linspace rounds by the CPU's
// vector width, so the map is computed with the same ops, not tabulated;
// a checkpoint carries its own map, which dequantization uses).
std::array<float, 256> make_dynamic_map() {
  std::vector<at::Tensor> parts;
  for (int i = 0; i < 7; ++i) {
    const auto b = at::linspace(0.1, 1.0, (1 << i) + 1, at::kFloat);
    const auto means = (b.slice(0, 0, -1) + b.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, i - 6);
    parts.push_back(means * scale);
    parts.push_back(means * -scale);
  }
  parts.push_back(at::tensor({0.0f, 1.0f}, at::kFloat));
  const auto sorted = std::get<0>(at::cat(parts).sort());
  TORCH_INTERNAL_ASSERT(sorted.numel() == 256);
  std::array<float, 256> out{};
  std::copy(sorted.const_data_ptr<float>(), sorted.const_data_ptr<float>() + 256, out.begin());
  return out;
}

const std::array<float, 256>& dynamic_map() {
  static const std::array<float, 256> map = make_dynamic_map();
  return map;
}

// The code of `scaled` (a value over its block's absmax): the number of
// midpoints of the sorted table below it, mapped back to its code.
struct Rounder {
  std::array<float, 15> midpoints{};
  std::array<uint8_t, 16> code_of_rank{};
  bool sign_bit = false;  // FP4: magnitudes ranked, the sign in bit 3

  explicit Rounder(QuantType type) {
    const auto& table = table_of(type);
    sign_bit = type == QuantType::kFP4;
    const int count = sign_bit ? 8 : 16;
    std::array<int, 16> order{};
    for (int i = 0; i < count; ++i) order[i] = i;
    std::sort(order.begin(), order.begin() + count,
              [&](int a, int b) { return table[a] < table[b]; });
    for (int i = 0; i < count; ++i) code_of_rank[i] = static_cast<uint8_t>(order[i]);
    for (int i = 0; i + 1 < count; ++i)
      midpoints[i] = (table[order[i]] + table[order[i + 1]]) / 2.0f;
  }
  uint8_t operator()(float scaled) const {
    const int count = sign_bit ? 7 : 15;
    const float v = sign_bit ? std::fabs(scaled) : scaled;
    // The midpoints below v, counted without branches (they are sorted, so
    // this is the first one not below it; a tie stays with the lower code).
    int rank = 0;
    for (int k = 0; k < count; ++k) rank += v > midpoints[k];
    const uint8_t code = code_of_rank[rank];
    return sign_bit && scaled < 0 ? static_cast<uint8_t>(code | 8) : code;
  }
};

// The nearest value of the sorted dynamic map (a tie to the even index).
uint8_t nearest_dynamic(float x) {
  const auto& map = dynamic_map();
  const auto it = std::lower_bound(map.begin(), map.end(), x);
  if (it == map.begin()) return 0;
  if (it == map.end()) return 255;
  const int hi = static_cast<int>(it - map.begin()), lo = hi - 1;
  const float mid = (map[lo] + map[hi]) * 0.5f;
  if (x < mid) return static_cast<uint8_t>(lo);
  if (x > mid) return static_cast<uint8_t>(hi);
  return static_cast<uint8_t>(lo % 2 == 0 ? lo : hi);
}

float block_absmax(const float* x, int64_t n) {
  float m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

template <typename T>
void dequantize_cpu(const Quantized4Bit& q, const float* absmax, T* out) {
  const auto& table = table_of(q.type);
  const uint8_t* packed = q.packed.const_data_ptr<uint8_t>();
  const int64_t n = q.numel();
  // One thread: this runs on a simulated device's worker, beside the
  // optimizer's pool (which it must not wait for); the GPUs have a kernel.
  for (int64_t b = 0; b < (n + q.blocksize - 1) / q.blocksize; ++b) {
    const float scale = absmax[b];
    for (int64_t i = b * q.blocksize; i < std::min(n, (b + 1) * q.blocksize); ++i) {
      const uint8_t byte = packed[i / 2];
      const uint8_t code = i % 2 == 0 ? byte >> 4 : byte & 15;
      out[i] = static_cast<T>(table[code] * scale);
    }
  }
}

}  // namespace

QuantType quant_type_from_string(const std::string& text) {
  if (text == "nf4") return QuantType::kNF4;
  if (text == "fp4") return QuantType::kFP4;
  if (text == "int8") return QuantType::kInt8;
  if (text == "fp8") return QuantType::kFP8;
  TORCH_CHECK_VALUE(false, "unknown quantization '", text, "': use nf4, fp4, int8 or fp8");
}

const char* to_string(QuantType type) {
  switch (type) {
    case QuantType::kNF4:
      return "nf4";
    case QuantType::kFP4:
      return "fp4";
    case QuantType::kInt8:
      return "int8";
    default:
      return "fp8";
  }
}

int64_t Quantized4Bit::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t Quantized4Bit::nbytes() const {
  int64_t bytes = packed.nbytes() + absmax.nbytes();
  if (double_quantized())
    bytes += nested_absmax.nbytes() + nested_code.nbytes() + nested_offset.nbytes();
  return bytes;
}

Quantized4Bit Quantized4Bit::to(const c10::Device& device, bool non_blocking) const {
  Quantized4Bit out = *this;
  out.packed = packed.to(device, non_blocking);
  out.absmax = absmax.to(device, non_blocking);
  if (double_quantized()) {
    out.nested_absmax = nested_absmax.to(device, non_blocking);
    out.nested_offset = nested_offset.to(device, non_blocking);
    out.nested_code = nested_code.to(device, non_blocking);
  }
  return out;
}

at::Tensor code_table(QuantType type) {
  const auto& t = table_of(type);
  return at::tensor(c10::ArrayRef<float>(t.data(), t.size()), at::kFloat);
}

at::Tensor dynamic_map_signed() {
  const auto& m = dynamic_map();
  return at::tensor(c10::ArrayRef<float>(m.data(), m.size()), at::kFloat);
}

Quantized4Bit quantize_4bit(const at::Tensor& weight, QuantType type, int64_t blocksize,
                            bool double_quant) {
  TORCH_CHECK_VALUE(weight.device().is_cpu(), "quantize_4bit takes a CPU tensor, got one on ",
                    weight.device());
  TORCH_CHECK_VALUE(at::isFloatingType(weight.scalar_type()) && weight.numel() > 0,
                    "quantize_4bit takes a non-empty float tensor, got ", weight.scalar_type(),
                    " with ", weight.numel(), " elements");
  TORCH_CHECK_VALUE(blocksize >= 2 && blocksize % 2 == 0, "the block size must be even, got ",
                    blocksize);
  Quantized4Bit q;
  q.type = type;
  q.blocksize = blocksize;
  q.shape = weight.sizes().vec();
  q.dtype = weight.scalar_type();
  const auto flat = weight.contiguous().to(at::kFloat).view(-1);
  const float* x = flat.const_data_ptr<float>();
  const int64_t n = flat.numel(), blocks = (n + blocksize - 1) / blocksize;
  auto absmax = at::empty({blocks}, at::kFloat);
  q.packed = at::empty({(n + 1) / 2}, at::kByte);
  float* amax = absmax.mutable_data_ptr<float>();
  uint8_t* packed = q.packed.mutable_data_ptr<uint8_t>();
  const Rounder round(type);
  const uint8_t zero = round(0.0f);
  // On the process's CPU pool (at::parallel_for runs on one thread in code
  // built without OpenMP, as ours is): a model's weights quantize as they load.
  constexpr int64_t kBlocksPerTask = 1024;
  parallel_for_each((blocks + kBlocksPerTask - 1) / kBlocksPerTask, [&](int64_t task) {
    const int64_t b0 = task * kBlocksPerTask, b1 = std::min(blocks, b0 + kBlocksPerTask);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
      amax[b] = block_absmax(x + begin, end - begin);
      // (A block of zeros: codes of 0, as bitsandbytes' CPU path gives.)
      const float inverse = 1.0f / std::max(amax[b], 1e-38f);
      for (int64_t i = begin; i < end; i += 2) {  // (blocks start even)
        const uint8_t hi = round(x[i] * inverse);
        const uint8_t lo = i + 1 < end ? round(x[i + 1] * inverse) : zero;
        packed[i / 2] = static_cast<uint8_t>(hi << 4 | lo);
      }
    }
  });
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  const float offset = at::mean(absmax).item<float>();
  q.nested_offset = at::full({1}, offset, at::kFloat);
  const int64_t nested_blocks = (blocks + kNestedBlock - 1) / kNestedBlock;
  q.nested_absmax = at::empty({nested_blocks}, at::kFloat);
  q.nested_code = dynamic_map_signed();
  q.absmax = at::empty({blocks}, at::kByte);
  float* amax2 = q.nested_absmax.mutable_data_ptr<float>();
  uint8_t* codes = q.absmax.mutable_data_ptr<uint8_t>();
  std::vector<float> centered(blocks);
  for (int64_t b = 0; b < blocks; ++b) centered[b] = amax[b] - offset;
  for (int64_t j = 0; j < nested_blocks; ++j) {
    const int64_t begin = j * kNestedBlock, end = std::min(blocks, begin + kNestedBlock);
    amax2[j] = block_absmax(centered.data() + begin, end - begin);
    const float inverse = 1.0f / std::max(amax2[j], 1e-38f);
    for (int64_t b = begin; b < end; ++b) codes[b] = nearest_dynamic(centered[b] * inverse);
  }
  return q;
}

at::Tensor dequantize_4bit(const Quantized4Bit& q) {
  const auto device = q.packed.device();
  TORCH_CHECK_VALUE(q.packed.scalar_type() == at::kByte && q.packed.numel() == (q.numel() + 1) / 2,
                    "a 4-bit weight of ", q.numel(), " values needs ", (q.numel() + 1) / 2,
                    " packed bytes, got ", q.packed.numel());
  const int64_t blocks = (q.numel() + q.blocksize - 1) / q.blocksize;
  TORCH_CHECK_VALUE(q.absmax.numel() == blocks, "a 4-bit weight of ", q.numel(),
                    " values in blocks of ", q.blocksize, " needs ", blocks, " scales, got ",
                    q.absmax.numel());
  TORCH_CHECK_VALUE(
      !q.double_quantized() ||
          (q.nested_offset.defined() && q.nested_offset.numel() == 1 &&
           q.nested_offset.scalar_type() == at::kFloat && q.nested_offset.device() == device),
      "double-quantized 4-bit scales need their offset: a float32 tensor of one "
      "value on ",
      device);
  TORCH_CHECK_VALUE(q.dtype == at::kFloat || q.dtype == at::kHalf || q.dtype == at::kBFloat16,
                    "4-bit weights dequantize to float32, float16 or bfloat16, not ", q.dtype);
  auto out = at::empty(q.shape, at::TensorOptions().dtype(q.dtype).device(device));
#ifdef ROUNDPIPE_WITH_CUDA
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const bool nested = q.double_quantized();
    kernels::Code16 code{};
    std::copy(table_of(q.type).begin(), table_of(q.type).end(), code.value);
    ops::check_launch(kernels::dequantize_4bit(
        ops::kernel_dtype(out), code, q.packed.const_data_ptr<uint8_t>(),
        nested ? nullptr : q.absmax.const_data_ptr<float>(),
        nested ? q.absmax.const_data_ptr<uint8_t>() : nullptr,
        nested ? q.nested_absmax.const_data_ptr<float>() : nullptr,
        nested ? q.nested_code.const_data_ptr<float>() : nullptr,
        nested ? q.nested_offset.const_data_ptr<float>() : nullptr, out.mutable_data_ptr(),
        q.numel(), q.blocksize, ops::current_stream()));
    return out;
  }
#endif
  TORCH_CHECK_VALUE(device.is_cpu(), "4-bit weights dequantize on a CPU or a CUDA GPU, not ",
                    device);
  // The block scales: float32, or their 8-bit codes decoded.
  at::Tensor absmax = q.absmax;
  if (q.double_quantized()) {
    absmax = at::empty({blocks}, at::kFloat);
    const uint8_t* codes = q.absmax.const_data_ptr<uint8_t>();
    const float* code2 = q.nested_code.const_data_ptr<float>();
    const float* amax2 = q.nested_absmax.const_data_ptr<float>();
    const float offset = q.nested_offset.item<float>();
    float* a = absmax.mutable_data_ptr<float>();
    for (int64_t b = 0; b < blocks; ++b) {
      const float scaled = code2[codes[b]] * amax2[b / kNestedBlock];
      a[b] = scaled + offset;
    }
  }
  const float* a = absmax.const_data_ptr<float>();
  switch (q.dtype) {
    case at::kFloat:
      dequantize_cpu(q, a, out.mutable_data_ptr<float>());
      break;
    case at::kHalf:
      dequantize_cpu(q, a, out.mutable_data_ptr<c10::Half>());
      break;
    default:
      dequantize_cpu(q, a, out.mutable_data_ptr<c10::BFloat16>());
      break;
  }
  return out;
}

}  // namespace roundpipe::models

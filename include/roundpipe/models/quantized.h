// Frozen base weights in 4 or 8 bits. 4 bits (QLoRA, Note [4-bit base weights]): NF4 or
// FP4 codes in blocks of 64 values, each block scaled by its absolute
// maximum, the block scales themselves quantized to 8 bits (double
// quantization), in bitsandbytes' layout, so that a model loaded with
// transformers' BitsAndBytesConfig(load_in_4bit=True) is used as it is.
// The weights stay packed in host memory and over PCIe; a layer's are
// dequantized where they are used (a CUDA kernel on a GPU, a CPU loop on
// the simulated devices). 8 bits (Note [8-bit base weights]): int8 in
// bitsandbytes' LLM.int8 layout (load_in_8bit), or FP8 e4m3, each row with
// its own float32 scale.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace roundpipe::models {

enum class QuantType { kNF4, kFP4, kInt8, kFP8 };
// "nf4", "fp4", "int8" or "fp8"; throws naming the choices.
QuantType quant_type_from_string(const std::string& text);
const char* to_string(QuantType type);
inline bool is_4bit(QuantType type) {
  return type == QuantType::kNF4 || type == QuantType::kFP4;
}

// How a preset keeps its frozen base weights (CausalLMOptions::quantize_base).
struct BaseQuantization {
  QuantType type = QuantType::kNF4;
  // 4 bits: the block scales double quantized (bitsandbytes'
  // bnb_4bit_use_double_quant); otherwise float32.
  bool double_quant = true;
};

struct Quantized4Bit {
  QuantType type = QuantType::kNF4;
  int64_t blocksize = 64;
  std::vector<int64_t> shape;              // of the weight
  c10::ScalarType dtype = c10::kBFloat16;  // what dequantization gives
  // uint8 [ceil(n / 2)]: the codes of the row-major flattened weight, two a
  // byte, the even element's in the high nibble (an odd n pads with 0.0's).
  at::Tensor packed;
  // The blocks' absolute maxima [ceil(n / blocksize)]: float32, or (double
  // quantized) uint8 codes of `nested_code` in blocks of 256, each scaled by
  // its `nested_absmax`, plus `nested_offset`.
  at::Tensor absmax;
  at::Tensor nested_absmax;  // float32 [ceil(blocks / 256)]; undefined: not nested
  at::Tensor nested_code;    // float32 [256]: bitsandbytes' signed dynamic map
  // float32 [1]: the block maxima's mean, added back. A tensor, so that it
  // travels to the device with the rest and dequantization never waits for
  // the host.
  at::Tensor nested_offset;

  bool double_quantized() const { return nested_absmax.defined(); }
  int64_t numel() const;
  // The bytes a copy of it moves (what crosses PCIe for this weight).
  int64_t nbytes() const;
  // The same on `device` (non_blocking copies from pinned memory).
  Quantized4Bit to(const c10::Device& device, bool non_blocking = false) const;
};

// The 16 values of a 4-bit code, float32: NF4 (the normal quantiles of the
// QLoRA paper, as bitsandbytes tabulates them) or FP4 (bitsandbytes' e2m1,
// sign in bit 3, scaled to [-1, 1]).
at::Tensor code_table(QuantType type);
// bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True)):
// 256 sorted float32 values in [-1, 1], for the block scales.
at::Tensor dynamic_map_signed();

// `weight` (any float dtype, on the CPU) in 4 bits: each value times
// 1 / its block's absmax (float32) rounded to the nearest code (a tie to the
// lower one); with double_quant, the absmaxes less their mean rounded to
// the nearest value of the dynamic map in blocks of 256.
Quantized4Bit quantize_4bit(const at::Tensor& weight, QuantType type, int64_t blocksize = 64,
                            bool double_quant = true);

// The weight back, [shape] in `dtype`, on the device q's tensors live on:
// code * absmax in float32, rounded once to dtype (bitsandbytes' result,
// bit for bit). A CUDA kernel on a GPU, a CPU loop otherwise.
at::Tensor dequantize_4bit(const Quantized4Bit& q);

// A weight in 8 bits, one scale a row:
//   int8: bitsandbytes' LLM.int8 weight (Int8Params): `values` int8 [rows,
//     cols] = round(w * 127 / row absmax) of the weight in float16, `scale`
//     the row absmax (its SCB); w = values * scale * (1 / 127) in float32.
//   fp8: `values` float8 e4m3 as raw bytes (uint8 [rows, cols], so that
//     every path that moves or pins a tensor takes them), = w / scale
//     rounded to nearest even, `scale` = row absmax / 448 (e4m3's largest
//     value; 1 for a row of zeros); w = values * scale in float32.
// Either way rounded once to `dtype` at the end.
struct Quantized8Bit {
  QuantType type = QuantType::kInt8;
  c10::ScalarType dtype = c10::kBFloat16;  // what dequantization gives
  at::Tensor values;                       // [rows, cols]
  at::Tensor scale;                        // float32 [rows]
};

// `weight` [rows, cols] (a CPU float tensor) in 8 bits (kInt8 or kFP8).
Quantized8Bit quantize_8bit(const at::Tensor& weight, QuantType type);
// The weight back, [rows, cols] in q.dtype, where q's tensors live.
at::Tensor dequantize_8bit(const Quantized8Bit& q);

}  // namespace roundpipe::models

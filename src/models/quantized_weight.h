// A frozen base weight kept quantized as parameters of the module that
// uses it (internal; Note [Quantized base weights in the presets]): the
// codes under the weight's own name (4 bits: uint8 [ceil(n / 2), 1]; 8
// bits: the weight's shape), their scales beside it
// ("<name>_absmax", "<name>_nested_absmax", "<name>_nested_code",
// "<name>_nested_offset" in 4 bits; "<name>_scale" in 8).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

#include "roundpipe/models/quantized.h"

namespace roundpipe::models::detail {

struct QuantizedWeight {
  static constexpr int64_t kBlock = 64;  // bitsandbytes' and QLoRA's block size
  BaseQuantization quant;
  std::vector<int64_t> shape;  // the weight's; 8 bits: a scale for each row of the last dim
  at::Tensor codes, absmax, nested_absmax, nested_code, nested_offset, scale;

  QuantizedWeight() = default;
  QuantizedWeight(BaseQuantization q, std::vector<int64_t> weight_shape)
      : quant(q), shape(std::move(weight_shape)) {}

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  // Registers uninitialised tensors on `owner` as frozen parameters.
  void register_on(torch::nn::Module& owner, const std::string& name) {
    auto add = [&](const std::string& suffix, at::Tensor t) {
      return owner.register_parameter(name + suffix, std::move(t), /*requires_grad=*/false);
    };
    if (!is_4bit(quant.type)) {
      codes = add("", at::empty(shape, quant.type == QuantType::kInt8 ? at::kChar : at::kByte));
      scale = add("_scale", at::empty(std::vector<int64_t>(shape.begin(), shape.end() - 1)));
      return;
    }
    const int64_t n = numel(), blocks = (n + kBlock - 1) / kBlock;
    // ([bytes, 1]: bitsandbytes' Params4bit shape, so that a model it
    // quantized lends its own parameters.)
    codes = add("", at::empty({(n + 1) / 2, 1}, at::kByte));
    if (!quant.double_quant) {
      absmax = add("_absmax", at::empty({blocks}));
      return;
    }
    absmax = add("_absmax", at::empty({blocks}, at::kByte));
    nested_absmax = add("_nested_absmax", at::empty({(blocks + 255) / 256}));
    nested_code = add("_nested_code", dynamic_map_signed());
    nested_offset = add("_nested_offset", at::empty({1}));
  }
  // The weight [shape] in `dtype`, where the codes live.
  at::Tensor dequantize(c10::ScalarType dtype) const {
    if (!is_4bit(quant.type)) {
      const Quantized8Bit q{quant.type, dtype, codes.view({-1, shape.back()}), scale.view(-1)};
      return dequantize_8bit(q).view(shape);
    }
    Quantized4Bit q;
    q.type = quant.type;
    q.blocksize = kBlock;
    q.shape = shape;
    q.dtype = dtype;
    q.packed = codes;
    q.absmax = absmax;
    q.nested_absmax = nested_absmax;
    q.nested_code = nested_code;
    q.nested_offset = nested_offset;
    return dequantize_4bit(q);
  }
  // Quantizes `w` [shape] (a CPU float tensor) into the parameters.
  void set(const at::Tensor& w) {
    TORCH_CHECK(w.sizes() == at::IntArrayRef(shape), "a weight of shape ", w.sizes(),
                " for a quantized weight of shape ", at::IntArrayRef(shape));
    if (is_4bit(quant.type))
      assign(quantize_4bit(w, quant.type, kBlock, quant.double_quant));
    else
      assign(quantize_8bit(w.reshape({-1, shape.back()}), quant.type));
  }
  // Whether `q` is in this weight's format and shape (assign takes it).
  bool takes(const Quantized4Bit& q) const {
    return q.type == quant.type && q.blocksize == kBlock &&
           q.double_quantized() == quant.double_quant && q.shape == shape;
  }
  bool takes(const Quantized8Bit& q) const {
    return q.type == quant.type && q.values.dim() == 2 && q.values.size(1) == shape.back() &&
           q.values.numel() == numel();
  }
  void assign(const Quantized4Bit& q) {
    TORCH_CHECK(takes(q), "a ", to_string(q.type), " weight for a ", to_string(quant.type),
                " one of another layout");
    std::vector<std::pair<at::Tensor*, at::Tensor>> parts = {{&codes, q.packed.view({-1, 1})},
                                                             {&absmax, q.absmax}};
    if (quant.double_quant)
      parts.insert(parts.end(), {{&nested_absmax, q.nested_absmax},
                                 {&nested_code, q.nested_code},
                                 {&nested_offset, q.nested_offset}});
    take(parts);
  }
  void assign(const Quantized8Bit& q) {
    TORCH_CHECK(takes(q), "a ", to_string(q.type), " weight for a ", to_string(quant.type),
                " one of another shape");
    take({{&codes, q.values.view(shape)}, {&scale, q.scale.view(scale.sizes())}});
  }
  // Each parameter gets its new value: copied in where it has the same
  // shape and dtype (keeping pinned memory pinned), else replaced.
  static void take(const std::vector<std::pair<at::Tensor*, at::Tensor>>& parts) {
    c10::NoGradGuard no_grad;
    for (const auto& [mine, theirs] : parts) {
      if (mine->sizes() == theirs.sizes() && mine->dtype() == theirs.dtype())
        mine->copy_(theirs);
      else
        mine->set_data(theirs.contiguous());
    }
  }
  // Its parameters (to keep their dtypes when the module's change).
  std::vector<at::Tensor> tensors() const {
    std::vector<at::Tensor> out;
    for (const auto* t : {&codes, &absmax, &nested_absmax, &nested_code, &nested_offset, &scale})
      if (t->defined()) out.push_back(*t);
    return out;
  }
};

// x W^T + bias for a frozen quantized W, where autograd keeps the packed
// weight, not the dequantized one, for the input's gradient
// (quantized_linear.cpp, Note [Dequantized weights are not kept]).
at::Tensor quantized_linear(const at::Tensor& x, const QuantizedWeight& weight,
                            const at::Tensor& bias = {});

// Whether a parameter name is one of a quantized weight's scales (saved
// and loaded with its weight, never on their own).
inline bool is_quantization_scale_name(const std::string& name) {
  for (const char* suffix :
       {"_absmax", "_nested_absmax", "_nested_code", "_nested_offset", "_scale"}) {
    for (const char* weight : {".weight", ".gate_up_proj", ".down_proj"}) {
      const std::string s = std::string(weight) + suffix;
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0)
        return true;
    }
  }
  return false;
}

}  // namespace roundpipe::models::detail

// The presets' basic modules (internal): a bare weight, a projection with
// an optional LoRA adapter, the embedding, RMSNorm, and the copy that
// Cloneable needs. Shared by the building blocks (models/README.md).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/quantized_weight.h"
#include "roundpipe/layer.h"
#include "roundpipe/models/causal_lm.h"
#include "roundpipe/models/fused_ops.h"
#include "roundpipe/models/quantized.h"

namespace roundpipe::models::detail {

// ---------------------------------------------------------------- modules

// Weights are allocated uninitialised: a new model is initialised by
// CausalLM's constructor (as transformers does), a loaded one overwritten,
// and a RoundPipe instance rebound to device copies.
// A bare weight [rows, cols] under the name "weight": one factor of a LoRA
// adapter ("lora_A.weight"), a MoE router ("gate.weight").
struct BareWeightImpl : torch::nn::Cloneable<BareWeightImpl> {
  int64_t rows, cols;
  at::Tensor weight;
  BareWeightImpl(int64_t r, int64_t c) : rows(r), cols(c) { reset(); }
  void reset() override { weight = register_parameter("weight", at::empty({rows, cols})); }
};
TORCH_MODULE(BareWeight);

// Note [Quantized base weights in the presets]
// With CausalLMOptions::quantize_base, each decoder layer's dense projection
// keeps its base weight quantized. In 4 bits, bitsandbytes' layout
// (quantized.h, Note [4-bit base weights]): the packed codes in `weight`,
// the block scales in `weight_absmax` (float32, or double quantized: uint8
// codes, with `weight_nested_absmax`, `weight_nested_code` (the dynamic
// map) and `weight_nested_offset`). In 8 bits (Note [8-bit base weights]):
// int8 or e4m3 bytes [out, in] in `weight`, a float32 scale a row in
// `weight_scale`. All are frozen parameters: RoundPipe uploads them with
// the layer (4.13 or 8 bits a value instead of 16: 3.9 or 2 x fewer host
// and PCIe bytes for these weights), never downloads or updates them (no
// gradient), and the projection dequantizes its weight into the input's
// dtype where it runs (a CUDA kernel on a GPU for 4 bits, tensor
// operations for 8) before its matmul, and again in the backward for the
// input's gradient: autograd keeps the packed weight, not the dequantized
// one (Note [Dequantized weights are not kept]). The LoRA
// factors keep their own dtype. from_pretrained quantizes each projection
// as it reads it, so the full-precision model is never held;
// save_pretrained writes the weights dequantized in the model's dtype (the
// values the model computes with); merge_lora is refused. The experts of
// mixture-of-experts layers are quantized the same way (Note [Quantized
// experts]).
// A projection, with a LoRA adapter where `lora.rank` > 0 (LoraOptions),
// and its base weight quantized where `quant` is set (Note [Quantized base
// weights in the presets]).
struct LinearImpl : torch::nn::Cloneable<LinearImpl> {
  int64_t in, out;
  bool has_bias;
  LoraOptions lora;
  std::optional<BaseQuantization> quant;
  // `weight`: [out, in], or with `quant` its codes, their scales beside
  // them (`base`); all frozen parameters, so that they travel with the
  // layer and are never written back.
  at::Tensor weight, bias;
  QuantizedWeight base;
  BareWeight lora_A{nullptr}, lora_B{nullptr};
  LinearImpl(int64_t i, int64_t o, bool b, LoraOptions l = {},
             std::optional<BaseQuantization> q = {})
      : in(i), out(o), has_bias(b), lora(std::move(l)), quant(q) {
    reset();
  }
  void reset() override {
    if (quant) {
      base = QuantizedWeight{*quant, {out, in}};
      base.register_on(*this, "weight");
      weight = base.codes;
    } else {
      weight = register_parameter("weight", at::empty({out, in}));
    }
    if (has_bias) bias = register_parameter("bias", at::empty({out}));
    if (lora.rank > 0) {
      lora_A = register_module("lora_A", BareWeight(lora.rank, in));
      lora_B = register_module("lora_B", BareWeight(out, lora.rank));
    }
  }
  // Note [LoRA compute dtype]
  // The adapter path runs in the input's dtype: on a bf16/fp16 base the
  // factors (float32, as peft keeps them, and so their masters) are cast to
  // it on the device, and their gradients cast back. Computing it in
  // float32 as peft does (the input cast up, float32 matmuls) made one
  // Qwen3-8B layer's projections 1.82 x as slow as the base ones alone; in
  // bf16, 1.27 x. Fusing A's matmul with the base one ([W; A] in one
  // matmul) was slower still: 1.57 x, the concatenation included
  // (bench/lora_matmul_bench.py). On a float32 base nothing changes.
  // The base weight [out, in]: `weight`, or dequantized into `dtype`.
  at::Tensor base_weight(c10::ScalarType dtype) const {
    return quant ? base.dequantize(dtype) : weight;
  }
  at::Tensor forward(const at::Tensor& x) {
    auto y = quant ? quantized_linear(x, base, bias) : at::linear(x, weight, bias);
    if (lora.rank == 0) return y;
    const auto h = lora.dropout > 0 ? at::dropout(x, lora.dropout, is_training()) : x;
    const auto a = lora_A->weight.to(x.scalar_type()), b = lora_B->weight.to(x.scalar_type());
    return at::add(y, at::linear(at::linear(h, a), b), lora.scaling());
  }
};
TORCH_MODULE(Linear);

// A projection named `projection` ("q_proj", ...): with an adapter where
// `lora` targets it.
// `quant`: its base weight quantized.
inline Linear make_linear(int64_t in, int64_t out, bool bias, const LoraOptions& lora = {},
                          const std::string& projection = "",
                          std::optional<BaseQuantization> quant = std::nullopt) {
  return Linear(in, out, bias, lora.targets_projection(projection) ? lora : LoraOptions{}, quant);
}

// Refuses LoRA options the presets cannot honour (unknown targets, expert
// targets without experts, dropout on experts), naming the fix (lora.cpp).
void check_lora(const CausalLMConfig& config, const LoraOptions& lora);

struct EmbeddingImpl : torch::nn::Cloneable<EmbeddingImpl> {
  int64_t count, dim;
  at::Tensor weight;
  EmbeddingImpl(int64_t n, int64_t d) : count(n), dim(d) { reset(); }
  void reset() override { weight = register_parameter("weight", at::empty({count, dim})); }
  at::Tensor forward(const at::Tensor& ids) { return at::embedding(weight, ids); }
};
TORCH_MODULE(Embedding);

// A copy of `self` built by `make` (uninitialised), with the original's
// tensors copied in, except for a RoundPipe instance, whose tensors are
// replaced anyway.
template <typename Make>
std::shared_ptr<torch::nn::Module> copy_module(const torch::nn::Module& self, Make make) {
  auto copy = make();
  if (!making_layer_instance()) {
    c10::NoGradGuard no_grad;
    auto src = self.parameters(), dst = copy->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    auto bsrc = self.buffers(), bdst = copy->buffers();
    for (size_t i = 0; i < bsrc.size(); ++i) bdst[i].copy_(bsrc[i]);
  }
  copy->train(self.is_training());
  return copy;
}

struct RMSNormImpl : torch::nn::Cloneable<RMSNormImpl> {
  int64_t dim;
  double eps;
  at::Tensor weight;
  RMSNormImpl(int64_t d, double e) : dim(d), eps(e) { reset(); }
  void reset() override { weight = register_parameter("weight", at::ones({dim})); }
  at::Tensor forward(const at::Tensor& x) { return ops::rms_norm(x, weight, eps); }
};
TORCH_MODULE(RMSNorm);

}  // namespace roundpipe::models::detail

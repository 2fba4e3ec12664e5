// Mixture-of-experts layers of the presets (internal): the stacked experts
// with their LoRA factors, and the sparse MoE block (router, top-k routing,
// the experts as grouped products). The routing and the experts' own
// autograd live in experts.cpp.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>

#include <optional>

#include "models/attention.h"
#include "models/modules.h"
#include "roundpipe/models/causal_lm.h"

namespace roundpipe::models::detail {

// Note [Expert LoRA]
// peft adapts a stacked weight [E, out, in] (target_parameters, its
// lora.ParamWrapper) with one pair of factors for all experts: A [r E, in]
// whose rows e r .. e r + r - 1 are expert e's, and B [out, r E] whose
// columns e, E + e, 2 E + e, ... are expert e's, so that expert e's weight
// is W_e + scaling B_e A_e. Here the adapter runs as two more products over
// the same sorted rows (x A_e^T, then B_e^T; never W + BA materialised).
// Adapting both weights, peft nests its wrappers in the order the module
// registers them: gate_up_proj's inside, its factors named
// "experts.base_layer.lora_{A,B}.weight", down_proj's outside,
// "experts.lora_{A,B}.weight"; one alone is "experts.lora_{A,B}.weight".
// The names here are those, so that adapters load from and save to peft.
struct LoraFactorsImpl : torch::nn::Cloneable<LoraFactorsImpl> {
  int64_t experts, in, out, rank;
  double scaling;
  BareWeight lora_A{nullptr}, lora_B{nullptr};
  LoraFactorsImpl(int64_t e, int64_t i, int64_t o, const LoraOptions& lora)
      : experts(e), in(i), out(o), rank(lora.rank), scaling(lora.scaling()) {
    reset();
  }
  void reset() override {
    lora_A = register_module("lora_A", BareWeight(rank * experts, in));
    lora_B = register_module("lora_B", BareWeight(out, rank * experts));
  }
  // [E, r, in]: expert e's A.
  static at::Tensor a_of(const at::Tensor& A, int64_t experts, at::ScalarType dtype) {
    return A.to(dtype).view({experts, -1, A.size(1)});
  }
  // [E, out, r]: expert e's B (a copy: _grouped_mm takes row- or
  // column-major operands only).
  static at::Tensor b_of(const at::Tensor& B, int64_t experts, at::ScalarType dtype) {
    return B.to(dtype).view({B.size(0), -1, experts}).permute({2, 0, 1}).contiguous();
  }
  at::Tensor a(at::ScalarType dtype) const { return a_of(lora_A->weight, experts, dtype); }
  at::Tensor b(at::ScalarType dtype) const { return b_of(lora_B->weight, experts, dtype); }
};
TORCH_MODULE(LoraFactors);

// A stacked expert weight as [E, out, in] (a view): GPT-OSS stores
// [E, in, out] (Note [GPT-OSS]).
inline at::Tensor stacked_out_in(const at::Tensor& weight, bool gpt_oss) {
  return gpt_oss ? weight.transpose(1, 2) : weight;
}

// Note [GPT-OSS]
// GPT-OSS's experts (transformers' GptOssExperts) store their weights
// [E, in, out] ("gate_up_proj" [E, H, 2I], "down_proj" [E, I, H], so on
// disk too), add a bias per expert ("gate_up_proj_bias", "down_proj_bias"),
// interleave gate and up columns (gate the even ones), and gate with
// (clamp(up, -l, l) + 1) * g * sigmoid(1.702 g), g = min(gate, l), l = 7.
// The router is a linear layer with a bias ("router.weight", ".bias"); its
// top-k logits' softmax is the full softmax's top k renormalised, which is
// what the routing here computes. The attention has biases and a sink per
// head (Note [Attention sinks]); layers alternate sliding-window (128) and
// full attention; rotary is yarn-scaled.
// Note [Quantized experts]
// With a quantized base (CausalLMOptions::quantize_base and
// quantize_experts), each stacked expert weight is kept quantized as it is
// stored ([E, out, in], GPT-OSS's [E, in, out]) as one QuantizedWeight: in
// 4 bits its flattened values in blocks of 64 (an expert's weight is a
// whole number of blocks in every real model, so no block spans two
// experts), in 8 bits a scale for each row of the last dimension. The
// layer dequantizes both stacks into the input's dtype where it runs, as
// the dense projections do: the device holds the full-precision stacks
// the bf16 model would upload, the host and PCIe a quarter (or half) of
// them. transformers' bitsandbytes loading quantizes nn.Linear modules
// only, so a model it loads keeps its stacked experts in full precision:
// quantize_experts = false keeps them so.
struct MoeExpertsImpl : torch::nn::Cloneable<MoeExpertsImpl> {
  int64_t experts, hidden, intermediate;
  bool gpt_oss;  // Note [GPT-OSS]
  LoraOptions lora;
  std::optional<BaseQuantization> quant;  // Note [Quantized experts]
  at::Tensor gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias;
  QuantizedWeight gate_up_quantized, down_quantized;      // with `quant`
  LoraFactors gate_up_lora{nullptr}, down_lora{nullptr};  // Note [Expert LoRA]
  MoeExpertsImpl(int64_t e, int64_t h, int64_t i, bool gpt_oss_layout, LoraOptions l,
                 std::optional<BaseQuantization> q = std::nullopt)
      : experts(e),
        hidden(h),
        intermediate(i),
        gpt_oss(gpt_oss_layout),
        lora(std::move(l)),
        quant(q) {
    reset();
  }
  void reset() override {
    if (quant) {
      // (Biases stay in full precision.)
      const std::vector<int64_t> gate_up =
          gpt_oss ? std::vector<int64_t>{experts, hidden, 2 * intermediate}
                  : std::vector<int64_t>{experts, 2 * intermediate, hidden};
      const std::vector<int64_t> down = gpt_oss
                                            ? std::vector<int64_t>{experts, intermediate, hidden}
                                            : std::vector<int64_t>{experts, hidden, intermediate};
      gate_up_quantized = QuantizedWeight{*quant, gate_up};
      gate_up_quantized.register_on(*this, "gate_up_proj");
      gate_up_proj = gate_up_quantized.codes;
      if (gpt_oss)
        gate_up_proj_bias =
            register_parameter("gate_up_proj_bias", at::empty({experts, 2 * intermediate}));
      down_quantized = QuantizedWeight{*quant, down};
      down_quantized.register_on(*this, "down_proj");
      down_proj = down_quantized.codes;
      if (gpt_oss)
        down_proj_bias = register_parameter("down_proj_bias", at::empty({experts, hidden}));
    } else if (gpt_oss) {
      gate_up_proj =
          register_parameter("gate_up_proj", at::empty({experts, hidden, 2 * intermediate}));
      gate_up_proj_bias =
          register_parameter("gate_up_proj_bias", at::empty({experts, 2 * intermediate}));
      down_proj = register_parameter("down_proj", at::empty({experts, intermediate, hidden}));
      down_proj_bias = register_parameter("down_proj_bias", at::empty({experts, hidden}));
    } else {
      gate_up_proj =
          register_parameter("gate_up_proj", at::empty({experts, 2 * intermediate, hidden}));
      down_proj = register_parameter("down_proj", at::empty({experts, hidden, intermediate}));
    }
    const bool gate_up = lora.targets_experts("gate_up_proj");
    const bool down = lora.targets_experts("down_proj");
    auto factors = [&](int64_t in, int64_t out, const char* weight) {
      return LoraFactors(experts, in, out, lora.for_experts(weight));
    };
    if (gate_up && down) {
      gate_up_lora =
          register_module("base_layer", factors(hidden, 2 * intermediate, "gate_up_proj"));
    } else if (gate_up) {
      gate_up_lora = factors(hidden, 2 * intermediate, "gate_up_proj");
    }
    if (down) down_lora = factors(intermediate, hidden, "down_proj");
    // The outer (or only) adapter's factors sit on this module itself.
    const auto outer = down ? down_lora : (gate_up && !down ? gate_up_lora : nullptr);
    if (outer) {
      register_module("lora_A", outer->lora_A);
      register_module("lora_B", outer->lora_B);
    }
  }
  // A stacked weight as [E, out, in] (a view).
  at::Tensor out_in(const at::Tensor& weight) const { return stacked_out_in(weight, gpt_oss); }
  // The tensors ExpertMath computes with, in its order (absent: empty); a
  // quantized stack dequantized into `dtype`.
  std::vector<at::Tensor> tensors(c10::ScalarType dtype) const {
    const auto none = at::empty({0});
    auto or_none = [&](const at::Tensor& t) { return t.defined() ? t : none; };
    auto factor = [&](const LoraFactors& f, bool b) {
      return f ? (b ? f->lora_B->weight : f->lora_A->weight) : none;
    };
    return {quant ? gate_up_quantized.dequantize(dtype) : gate_up_proj,
            quant ? down_quantized.dequantize(dtype) : down_proj,
            or_none(gate_up_proj_bias),
            or_none(down_proj_bias),
            factor(gate_up_lora, false),
            factor(gate_up_lora, true),
            factor(down_lora, false),
            factor(down_lora, true)};
  }
};
TORCH_MODULE(MoeExperts);

struct ExpertMath;

struct SparseMoeImpl : torch::nn::Cloneable<SparseMoeImpl> {
  CausalLMConfig config;
  bool grouped;
  int64_t chunk_tokens;  // > 0: longer inputs go by TokenChunkedExperts
  LoraOptions lora;
  std::optional<BaseQuantization> quant;  // the experts' (Note [Quantized experts])
  BareWeight gate{nullptr};               // the router (Qwen3-MoE)
  Linear router{nullptr};                 // GPT-OSS's, with a bias
  MoeExperts experts{nullptr};
  SparseMoeImpl(CausalLMConfig c, bool grouped_experts, int64_t chunk, LoraOptions l,
                std::optional<BaseQuantization> q = std::nullopt)
      : config(std::move(c)),
        grouped(grouped_experts),
        chunk_tokens(chunk),
        lora(std::move(l)),
        quant(q) {
    reset();
  }
  void reset() override {
    if (config.router_bias) {
      router = register_module("router", Linear(config.hidden_size, config.num_experts, true));
    } else {
      gate = register_module("gate", BareWeight(config.num_experts, config.hidden_size));
    }
    experts = register_module(
        "experts", MoeExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                              config.gpt_oss_experts, lora, quant));
  }
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    return copy_module(*this, [&] {
      return std::make_shared<SparseMoeImpl>(config, grouped, chunk_tokens, lora, quant);
    });
  }
  ExpertMath math() const;
  // The layer's output; with `stats`, its router statistics added into it
  // (Note [Router load-balancing loss]).
  at::Tensor forward(const at::Tensor& x, const std::optional<SequenceLayout>& layout = {},
                     at::Tensor* stats = nullptr);
};
TORCH_MODULE(SparseMoe);

// The router's load-balancing loss from statistics summed over a call
// (Note [Router load-balancing loss]).
at::Tensor router_aux_loss(const at::Tensor& stats);

}  // namespace roundpipe::models::detail

// Native Qwen3 and Llama (3.x) causal LMs, organised the way RoundPipe
// schedules best: an input adapter (embedding, rotary cos/sin, the
// attention layout), one layer per decoder block, and an output adapter
// (final norm, lm_head, loss).
//
// The model's input is a tensor of token ids [batch, seq] or the tuple
// (input_ids, attention_mask, labels, return_logits, position_ids,
// num_items_in_batch), each element after input_ids None or left out when
// not given (CausalLMInput::to_ivalue() builds it; the older 3- and
// 4-element tuples are this tuple's prefixes):
// - attention_mask [batch, seq]: 1 = token, 0 = padding (left, right or
//   anywhere). An all-ones mask is the same as none.
// - labels: -100 for ignored positions, shifted inside, as in HuggingFace.
// - return_logits (bool): overrides CausalLMOptions::return_logits.
// - position_ids [batch or 1, seq]: the rotary positions (default 0..seq-1
//   in every row, left padding included, as transformers). Without a mask,
//   positions that do not follow on (restarting at 0) separate packed
//   documents, which do not attend to each other (transformers'
//   DataCollatorWithFlattening convention; transformers itself keeps them
//   apart only without a cache, use_cache=False, as in training).
// - num_items_in_batch (number): the loss is the sum over the labelled
//   tokens divided by it; default: this input's own labelled-token count
//   (a mean). See count_loss_tokens for token-weighted microbatches.
// Padded and packed inputs never build a [seq, seq] mask: attention runs
// over variable-length sequences (flash attention on CUDA), and padding
// positions get a zero attention output (transformers' flash_attention_2
// does the same; its sdpa path differs there, in the logits at padding
// positions only).
// The output is the loss when labels are given (computed without
// materialising the [tokens, vocab] logits unless return_logits), else the
// logits; with labels and return_logits, a tuple (loss, logits).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/models/config.h"
#include "roundpipe/models/quantized.h"

namespace roundpipe::models {
namespace detail {
struct QuantizedWeight;  // models/quantized_weight.h
}  // namespace detail

// LoRA (low-rank adapters, as peft's LoraConfig) on the named projections
// of every decoder layer: y = x W^T + b + scaling * dropout(x) A^T B^T with
// A [rank, in] initialised as nn.Linear's weight (kaiming-uniform) and B
// [out, rank] at zero, scaling = alpha / rank (alpha / sqrt(rank) with
// use_rslora). Every other parameter is frozen (requires_grad false), as
// peft does. Names follow peft: "...q_proj.lora_A.weight".
struct LoraOptions {
  int64_t rank = 0;  // 0: no LoRA
  double alpha = 8;  // peft's lora_alpha default
  double dropout = 0;
  bool use_rslora = false;
  // The adapters' dtype (default: the model's). peft keeps adapters of a
  // half-precision model in float32: the adapter path then computes in it.
  std::optional<c10::ScalarType> dtype;
  // Projections: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
  // down_proj; {"all-linear"}: all of them (never lm_head); empty: all of
  // them too, unless target_parameters is set (peft's target_modules=None).
  std::vector<std::string> targets;
  // Mixture-of-experts layers' stacked expert weights, as peft's
  // target_parameters names them: "mlp.experts.gate_up_proj",
  // "mlp.experts.down_proj" (or a dot-separated ending of those, e.g.
  // "experts.down_proj"). One adapter per stacked weight, rank r per
  // expert (Note [Expert LoRA]); peft allows no dropout on them.
  std::vector<std::string> target_parameters;
  // Another rank and alpha for an expert weight ("gate_up_proj",
  // "down_proj"): peft's rank_pattern and alpha_pattern, which peft sets
  // when it maps target_modules gate_proj + up_proj of a transformers 5 MoE
  // model onto the fused gate_up_proj (twice the rank and alpha).
  std::map<std::string, int64_t> expert_rank;
  std::map<std::string, double> expert_alpha;

  double scaling() const;
  // These options with the rank and alpha of expert weight `weight`.
  LoraOptions for_experts(const std::string& weight) const;
  bool targets_projection(const std::string& projection) const;
  // Whether the experts' "gate_up_proj" or "down_proj" gets an adapter.
  bool targets_experts(const std::string& weight) const;
  LoraOptions& set_rank(int64_t v) {
    rank = v;
    return *this;
  }
  LoraOptions& set_alpha(double v) {
    alpha = v;
    return *this;
  }
  LoraOptions& set_dropout(double v) {
    dropout = v;
    return *this;
  }
  LoraOptions& set_use_rslora(bool v) {
    use_rslora = v;
    return *this;
  }
  LoraOptions& set_targets(std::vector<std::string> v) {
    targets = std::move(v);
    return *this;
  }
  LoraOptions& set_target_parameters(std::vector<std::string> v) {
    target_parameters = std::move(v);
    return *this;
  }
};

struct CausalLMOptions {
  c10::ScalarType dtype = c10::kFloat;  // weights and compute dtype
  bool return_logits = false;
  int64_t loss_chunk_tokens = 2048;  // tokens per chunk of the fused linear + cross-entropy
  // A microbatch of more tokens than this runs each MLP token chunk by token
  // chunk, recomputing a chunk's activations in backward (long sequences:
  // bounded activation memory for 1/3 more MLP forward work); 0 = never.
  int64_t mlp_chunk_tokens = 16384;
  // The same for a mixture-of-experts layer's experts, which hold
  // num_experts_per_tok rows per token (Note [Expert token chunks]).
  int64_t expert_chunk_tokens = 4096;
  // Allocate the weights in pinned host memory, so that from_pretrained
  // copies the mapped checkpoint straight into memory the GPUs upload from
  // (RoundPipe's pin_model=alloc then keeps it as is). Needs CUDA.
  bool pin_memory = false;
  // false: leave the weights uninitialised (their memory untouched, unless
  // pin_memory), for a model whose weights are loaded or replaced at once.
  bool init_weights = true;

  CausalLMOptions& set_dtype(c10::ScalarType v) {
    dtype = v;
    return *this;
  }
  CausalLMOptions& set_return_logits(bool v) {
    return_logits = v;
    return *this;
  }
  CausalLMOptions& set_loss_chunk_tokens(int64_t v) {
    loss_chunk_tokens = v;
    return *this;
  }
  CausalLMOptions& set_mlp_chunk_tokens(int64_t v) {
    mlp_chunk_tokens = v;
    return *this;
  }
  CausalLMOptions& set_expert_chunk_tokens(int64_t v) {
    expert_chunk_tokens = v;
    return *this;
  }
  CausalLMOptions& set_init_weights(bool v) {
    init_weights = v;
    return *this;
  }
  // from_pretrained: the checkpoint's memory-mapped pages become the weights
  // where the dtype matches (no copy: the weights stay file pages, which the
  // kernel may drop and read again, instead of anonymous memory; the mapping
  // is private, so a write copies its page and never reaches the file). For
  // models larger than host memory with pin_model "off" (frozen weights under
  // LoRA are never written). Ignored with pin_memory.
  bool map_weights = false;
  CausalLMOptions& set_map_weights(bool v) {
    map_weights = v;
    return *this;
  }
  // Mixture-of-experts layers run their experts as one grouped matrix
  // product (at::_grouped_mm) where it takes the shapes, else one product
  // per expert (Note [Expert routing]); false: always the loop.
  bool grouped_experts = true;
  CausalLMOptions& set_grouped_experts(bool v) {
    grouped_experts = v;
    return *this;
  }
  LoraOptions lora;  // rank 0: none
  CausalLMOptions& set_lora(LoraOptions v) {
    lora = std::move(v);
    return *this;
  }
  // QLoRA (Note [Quantized base weights in the presets]): the decoder
  // layers' dense projections (attention q/k/v/o, MLP gate/up/down) and
  // experts keep their base weights quantized, frozen, in host memory and
  // over PCIe, and dequantized into the compute dtype where they run: nf4 or
  // fp4 (codes in blocks of 64, bitsandbytes' layout), int8 (bitsandbytes'
  // LLM.int8 weights: a scale a row) or fp8 (e4m3, a scale a row).
  // from_pretrained quantizes a full-precision checkpoint as it reads it,
  // tensor by tensor. Embeddings, norms, lm_head and routers stay in `dtype`.
  std::optional<QuantType> quantize_base;
  CausalLMOptions& set_quantize_base(std::optional<QuantType> v) {
    quantize_base = v;
    return *this;
  }
  // 4 bits: the block scales quantized again to 8 bits (QLoRA's double
  // quantization, bitsandbytes' bnb_4bit_use_double_quant); false: float32.
  bool double_quant = true;
  CausalLMOptions& set_double_quant(bool v) {
    double_quant = v;
    return *this;
  }
  // With quantize_base, the experts too (false: they stay in `dtype`, as
  // transformers' bitsandbytes loading leaves stacked experts).
  bool quantize_experts = true;
  CausalLMOptions& set_quantize_experts(bool v) {
    quantize_experts = v;
    return *this;
  }
  // quantize_base and double_quant together (none without quantize_base).
  std::optional<BaseQuantization> base_quantization() const {
    if (!quantize_base) return std::nullopt;
    return BaseQuantization{*quantize_base, double_quant};
  }
};

// The model's input (see the top of this file).
struct CausalLMInput {
  at::Tensor input_ids;       // or inputs_embeds: exactly one of the two
  at::Tensor inputs_embeds;   // [batch, sequence, hidden], in place of the embedding
  at::Tensor attention_mask;  // undefined: none
  at::Tensor labels;          // undefined: none (the output is the logits)
  at::Tensor position_ids;    // undefined: 0..seq-1
  std::optional<bool> return_logits;
  std::optional<double> num_items_in_batch;
  c10::IValue to_ivalue() const;
};

// The number of labels the loss counts: labels[:, 1:] != -100 (labels
// shift left by one inside the model).
//
// Token-weighted microbatches: RoundPipe splits a batch into microbatches
// and forward_backward SUMS their losses, so give num_items_in_batch =
// count_loss_tokens(the whole batch's labels): each microbatch's loss is
// then its share and the sum is the whole batch's mean, with its gradients,
// for any num_microbatch. forward() AVERAGES 0-dim outputs over the
// microbatches instead: there give count_loss_tokens(labels) /
// num_microbatch.
int64_t count_loss_tokens(const at::Tensor& labels);

class CausalLM {
 public:
  // A randomly initialised model of this config.
  CausalLM(CausalLMConfig config, CausalLMOptions options = {});
  // Loads config.json and the safetensors weights (single file or sharded
  // with model.safetensors.index.json) of a HuggingFace checkpoint directory.
  static CausalLM from_pretrained(const std::string& dir, CausalLMOptions options = {});
  // Writes config.json and the weights (sharded past max_shard_bytes, with an
  // index) in HuggingFace's layout into `dir`, each file replaced atomically;
  // other files in `dir` are left alone, except the weight files of an
  // earlier save that this one does not overwrite.
  void save_pretrained(const std::string& dir, int64_t max_shard_bytes = int64_t{5} << 30) const;
  // The LoRA adapters in peft's layout (adapter_config.json,
  // adapter_model.safetensors with keys "base_model.model.<name>"), which
  // peft's PeftModel.from_pretrained loads onto the base model; other files
  // in `dir` are left alone. `base_model` names the base for peft.
  void save_adapter(const std::string& dir, const std::string& base_model = "") const;
  // Folds the adapters into the base weights (W += scaling * B A) and zeroes
  // B, so that save_pretrained writes the fine-tuned model whole. Refused on
  // a quantized base (it would quantize the sum again): save the adapter.
  void merge_lora();

  const CausalLMConfig& config() const { return config_; }
  const CausalLMOptions& options() const { return options_; }
  int64_t vocab_size() const { return config_.vocab_size; }
  // Sequential(input adapter, decoder layers..., output adapter).
  torch::nn::Sequential& sequential() { return sequential_; }
  // The weights under their HuggingFace names (tied lm_head omitted).
  std::vector<std::pair<std::string, at::Tensor>> hf_state_dict() const;
  // Whether a HuggingFace name is a LoRA parameter (not in a base checkpoint).
  static bool is_lora_name(const std::string& hf_name);
  // The HuggingFace name of parameter `name` of layer `layer`.
  std::string hf_name(size_t layer, const std::string& name) const;

 private:
  CausalLMConfig config_;
  CausalLMOptions options_;
  torch::nn::Sequential sequential_;
  void init_lora();
  // The quantized base weights, by their HuggingFace names (Note [Quantized
  // base weights in the presets]).
  std::map<std::string, detail::QuantizedWeight*> quantized_weights() const;
};

// Whether `name` is a weight file of a HuggingFace checkpoint
// (model.safetensors, model-00001-of-00002.safetensors, the index).
bool is_weight_file(const std::string& name);

// Cross-entropy of (hidden @ weight^T) against labels (ignore -100), summed
// and divided by `divisor` (default: the number of labelled tokens, a
// mean), chunked over tokens so the [tokens, vocab] logits never exist
// whole, in forward or backward. hidden [N, D], weight [V, D], labels [N].
at::Tensor chunked_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                        const at::Tensor& labels, int64_t chunk_tokens,
                                        std::optional<double> divisor = std::nullopt);

}  // namespace roundpipe::models

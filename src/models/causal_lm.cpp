// Qwen3 / Llama modules (following HuggingFace transformers' definitions
// operation by operation, so that logits and gradients match) and
// HuggingFace checkpoint IO.
#include "roundpipe/models/causal_lm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/cloneable.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "io/atomic_directory.h"
#include "models/attention.h"
#include "roundpipe/layer.h"
#include "roundpipe/models/fused_ops.h"
#include "roundpipe/safetensors.h"

namespace fs = std::filesystem;

namespace roundpipe::models {
namespace {

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

// A projection, with a LoRA adapter where `lora.rank` > 0 (LoraOptions).
struct LinearImpl : torch::nn::Cloneable<LinearImpl> {
  int64_t in, out;
  bool has_bias;
  LoraOptions lora;
  at::Tensor weight, bias;
  BareWeight lora_A{nullptr}, lora_B{nullptr};
  LinearImpl(int64_t i, int64_t o, bool b, LoraOptions l = {})
      : in(i), out(o), has_bias(b), lora(std::move(l)) {
    reset();
  }
  void reset() override {
    weight = register_parameter("weight", at::empty({out, in}));
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
  at::Tensor forward(const at::Tensor& x) {
    auto y = at::linear(x, weight, bias);
    if (lora.rank == 0) return y;
    const auto h = lora.dropout > 0 ? at::dropout(x, lora.dropout, is_training()) : x;
    const auto a = lora_A->weight.to(x.scalar_type()), b = lora_B->weight.to(x.scalar_type());
    return at::add(y, at::linear(at::linear(h, a), b), lora.scaling());
  }
};
TORCH_MODULE(Linear);

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

// Inverse rotary frequencies, as transformers computes them (float32).
at::Tensor inverse_frequencies(const CausalLMConfig& c) {
  const int64_t dim = c.head_dim;
  auto inv = 1.0 / at::pow(c.rope_theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) / dim);
  if (c.rope_scaling.type == "yarn") {
    // Interpolated (inv / factor) below the ramp, extrapolated (inv) above,
    // linear in between; the ramp's ends are the dimensions that turn
    // beta_fast and beta_slow times over the original context.
    const auto& r = c.rope_scaling;
    const double base = c.rope_theta, len = static_cast<double>(r.original_max_position_embeddings);
    auto dim_of = [&](double rotations) {
      return dim * std::log(len / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = dim_of(r.beta_fast), high = dim_of(r.beta_slow);
    if (r.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    const auto ramp = ((at::arange(dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
    const auto extrapolated = 1 - ramp;
    return inv / r.factor * (1 - extrapolated) + inv * extrapolated;
  }
  if (c.rope_scaling.type != "llama3") return inv;
  const auto& r = c.rope_scaling;
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_wavelen = old_len / r.low_freq_factor;
  const double high_wavelen = old_len / r.high_freq_factor;
  auto wavelen = 2 * M_PI / inv;
  auto scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
  auto smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  auto smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  auto medium = (wavelen < high_wavelen).logical_not() * (wavelen > low_wavelen).logical_not();
  return at::where(medium, smoothed, scaled);
}

// The model's input, read from the tuple (input_ids, attention_mask,
// labels, return_logits, position_ids, num_items_in_batch, inputs_embeds),
// every element after input_ids optional (None or left out; input_ids None
// where inputs_embeds is given), or from input_ids alone.
CausalLMInput parse_input(const c10::IValue& input) {
  CausalLMInput in;
  if (input.isTensor()) {
    in.input_ids = input.toTensor();
    return in;
  }
  TORCH_CHECK(input.isTuple(),
              "the model takes input_ids or a tuple (input_ids, attention_mask, labels, "
              "return_logits, position_ids, num_items_in_batch), None for what is not given "
              "(CausalLMInput::to_ivalue() builds it)");
  const auto& e = input.toTupleRef().elements();
  TORCH_CHECK(e.size() <= 7,
              "the model's input tuple has at most 7 elements (input_ids, attention_mask, labels, "
              "return_logits, position_ids, num_items_in_batch, inputs_embeds), got ",
              e.size());
  auto tensor_at = [&](size_t i, const char* name) {
    if (e.size() <= i || e[i].isNone()) return at::Tensor();
    TORCH_CHECK(e[i].isTensor(), "input element ", i, " (", name,
                ") must be a tensor or None, got ", e[i].tagKind());
    return e[i].toTensor();
  };
  in.input_ids = tensor_at(0, "input_ids");
  in.inputs_embeds = tensor_at(6, "inputs_embeds");
  TORCH_CHECK(
      in.input_ids.defined() != in.inputs_embeds.defined(),
      "give exactly one of input_ids and inputs_embeds (as transformers' models take them)");
  in.attention_mask = tensor_at(1, "attention_mask");
  in.labels = tensor_at(2, "labels");
  if (e.size() > 3 && !e[3].isNone()) {
    TORCH_CHECK(e[3].isBool(), "input element 3 (return_logits) must be a bool or None, got ",
                e[3].tagKind());
    in.return_logits = e[3].toBool();
  }
  in.position_ids = tensor_at(4, "position_ids");
  if (e.size() > 5 && !e[5].isNone()) {
    TORCH_CHECK(e[5].isDouble() || e[5].isInt(),
                "input element 5 (num_items_in_batch) must be a number or None, got ",
                e[5].tagKind(), "; pass count_loss_tokens(labels) of the whole batch as a number");
    in.num_items_in_batch = e[5].isInt() ? static_cast<double>(e[5].toInt()) : e[5].toDouble();
    TORCH_CHECK(*in.num_items_in_batch > 0, "num_items_in_batch must be positive, got ",
                *in.num_items_in_batch, " (leave it out for a batch without labelled tokens)");
  }
  return in;
}

// The token positions as [rows, T] float (rows 1 or batch): position_ids,
// else 0..T-1 for every row (transformers' default, left padding included).
at::Tensor token_positions(const CausalLMInput& in, int64_t B, int64_t T,
                           const c10::TensorOptions& float_options) {
  if (!in.position_ids.defined()) return at::arange(T, float_options).unsqueeze(0);
  const auto& p = in.position_ids;
  TORCH_CHECK(p.dim() == 2 && (p.size(0) == B || p.size(0) == 1) && p.size(1) == T,
              "position_ids must be [batch, sequence] (or [1, sequence]) like input_ids ([", B,
              ", ", T, "]), got ", p.sizes());
  return p.to(float_options);
}

// Embedding, rotary tables and the attention layout, computed once per
// microbatch and handed to every decoder layer in the tuple (hidden, cos,
// sin, layout or None, labels or None, return_logits or None,
// num_items_in_batch or None[, router statistics]).
struct InputAdapterImpl : torch::nn::Cloneable<InputAdapterImpl> {
  CausalLMConfig config;
  Embedding embed_tokens{nullptr};
  at::Tensor inv_freq;
  explicit InputAdapterImpl(CausalLMConfig c) : config(std::move(c)) { reset(); }
  void reset() override {
    embed_tokens =
        register_module("embed_tokens", Embedding(config.vocab_size, config.hidden_size));
    inv_freq = register_buffer("inv_freq", inverse_frequencies(config));
  }
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    return copy_module(*this, [&] { return std::make_shared<InputAdapterImpl>(config); });
  }
  c10::IValue forward(c10::IValue input) {
    const auto in = parse_input(input);
    at::Tensor hidden;
    if (in.inputs_embeds.defined()) {
      hidden = in.inputs_embeds;
      TORCH_CHECK(hidden.dim() == 3 && hidden.size(2) == config.hidden_size,
                  "inputs_embeds must be [batch, sequence, hidden_size = ", config.hidden_size,
                  "], got ", hidden.sizes());
      hidden = hidden.to(embed_tokens->weight.scalar_type());
    } else {
      TORCH_CHECK(in.input_ids.dim() == 2, "input_ids must be [batch, sequence], got ",
                  in.input_ids.sizes());
      hidden = embed_tokens(in.input_ids);
    }
    const int64_t B = hidden.size(0), T = hidden.size(1);
    const auto positions = token_positions(in, B, T, inv_freq.options());
    auto freqs = positions.unsqueeze(-1) * inv_freq;  // [rows, T, head_dim / 2]
    auto emb = at::cat({freqs, freqs}, -1);           // [rows, T, head_dim]
    auto cos = emb.cos(), sin = emb.sin();
    if (config.rope_scaling.type == "yarn") {  // (yarn's attention factor)
      cos = cos * config.rope_scaling.attention_factor;
      sin = sin * config.rope_scaling.attention_factor;
    }
    cos = cos.to(hidden.scalar_type());
    sin = sin.to(hidden.scalar_type());
    // Padding and packing become variable-length sequences (no [T, T]
    // mask); read on the host, then the offsets travel with the activations.
    c10::IValue layout;
    if (auto l = sequence_layout(in.attention_mask, in.position_ids, B, T)) {
      l->token_index = l->token_index.to(hidden.device());
      l->cu_seqlens = l->cu_seqlens.to(hidden.device());
      layout = l->to_ivalue();
    }
    auto optional = [](const auto& v) { return v ? c10::IValue(*v) : c10::IValue(); };
    std::vector<c10::IValue> out{hidden,
                                 cos,
                                 sin,
                                 layout,
                                 in.labels.defined() ? c10::IValue(in.labels) : c10::IValue(),
                                 optional(in.return_logits),
                                 optional(in.num_items_in_batch)};
    // (Note [Router load-balancing loss]: the loss's router statistics.)
    if (config.router_loss() && in.labels.defined())
      out.emplace_back(at::zeros({2 * config.num_experts + 1}, inv_freq.options()));
    return c10::ivalue::Tuple::create(std::move(out));
  }
};
TORCH_MODULE(InputAdapter);

Linear make_linear(int64_t in, int64_t out, bool bias, const LoraOptions& lora = {},
                   const std::string& projection = "") {
  return Linear(in, out, bias, lora.targets_projection(projection) ? lora : LoraOptions{});
}

// Submodule and parameter names follow transformers', so that the state dict
// maps one to one ("self_attn.q_proj.weight", "mlp.gate_proj.weight", ...).
struct AttentionImpl : torch::nn::Cloneable<AttentionImpl> {
  CausalLMConfig config;
  int64_t window;  // sliding window; 0: full causal attention
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  at::Tensor sinks;  // GPT-OSS: Note [Attention sinks]
  LoraOptions lora;
  AttentionImpl(CausalLMConfig c, int64_t w, LoraOptions l)
      : config(std::move(c)), window(w), lora(std::move(l)) {
    reset();
  }
  void reset() override {
    const auto& c = config;
    q_proj =
        register_module("q_proj", make_linear(c.hidden_size, c.num_attention_heads * c.head_dim,
                                              c.attention_bias, lora, "q_proj"));
    k_proj =
        register_module("k_proj", make_linear(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                              c.attention_bias, lora, "k_proj"));
    v_proj =
        register_module("v_proj", make_linear(c.hidden_size, c.num_key_value_heads * c.head_dim,
                                              c.attention_bias, lora, "v_proj"));
    o_proj =
        register_module("o_proj", make_linear(c.num_attention_heads * c.head_dim, c.hidden_size,
                                              c.attention_bias, lora, "o_proj"));
    if (c.qk_norm) {
      q_norm = register_module("q_norm", RMSNorm(c.head_dim, c.rms_norm_eps));
      k_norm = register_module("k_norm", RMSNorm(c.head_dim, c.rms_norm_eps));
    }
    if (c.attention_sinks) sinks = register_parameter("sinks", at::empty({c.num_attention_heads}));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::optional<SequenceLayout>& layout) {
    const int64_t B = x.size(0), T = x.size(1), hd = config.head_dim;
    auto q = q_proj(x).view({B, T, -1, hd});
    auto k = k_proj(x).view({B, T, -1, hd});
    auto v = v_proj(x).view({B, T, -1, hd});
    if (config.qk_norm) {
      q = q_norm(q);
      k = k_norm(k);
    }
    // Rotary in the projections' [B, T, heads, hd] layout (no copy);
    // attention takes that layout too.
    q = ops::rotary(q, cos, sin);
    k = ops::rotary(k, cos, sin);
    auto attn =
        causal_attention(q, k, v, layout, 1.0 / std::sqrt(static_cast<double>(hd)), window, sinks);
    return o_proj(attn.reshape({B, T, -1}));
  }
};
TORCH_MODULE(Attention);

// The MLP of a long sequence, token chunk by token chunk: forward keeps only
// its input; backward recomputes one chunk's [chunk, intermediate]
// activations at a time, so the MLP's activation memory is bounded by the
// chunk, not the sequence (the rest of a layer is linear in the sequence).
struct TokenChunkedMLP : torch::autograd::Function<TokenChunkedMLP> {
  // down(swiglu(gate(x), up(x))); an absent bias is an empty tensor (custom
  // functions take no undefined inputs).
  static at::Tensor body(const at::Tensor& x, const std::vector<at::Tensor>& p) {
    auto bias = [&](int i) { return p[i].numel() > 0 ? p[i] : at::Tensor(); };
    return at::linear(ops::swiglu(at::linear(x, p[0], bias(1)), at::linear(x, p[2], bias(3))), p[4],
                      bias(5));
  }
  static at::Tensor no_bias_if_absent(const at::Tensor& b) {
    return b.defined() ? b : at::empty({0});
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& gate_w, const at::Tensor& gate_b,
                            const at::Tensor& up_w, const at::Tensor& up_b,
                            const at::Tensor& down_w, const at::Tensor& down_b, int64_t chunk) {
    const std::vector<at::Tensor> p = {gate_w, gate_b, up_w, up_b, down_w, down_b};
    const auto flat = x.reshape({-1, x.size(-1)});
    auto out = at::empty({flat.size(0), down_w.size(0)}, x.options());
    for (int64_t start = 0; start < flat.size(0); start += chunk) {
      const int64_t len = std::min(chunk, flat.size(0) - start);
      out.narrow(0, start, len).copy_(body(flat.narrow(0, start, len), p));
    }
    ctx->save_for_backward({x, gate_w, gate_b, up_w, up_b, down_w, down_b});
    ctx->saved_data["chunk"] = chunk;
    auto sizes = x.sizes().vec();
    sizes.back() = down_w.size(0);
    return out.view(sizes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const auto flat = saved[0].reshape({-1, saved[0].size(-1)});
    const auto grad = grads[0].reshape({flat.size(0), -1});
    auto grad_x = at::empty_like(flat);
    // Parameter gradients add up over chunks in float32 (or wider).
    // Leaves for the parameters autograd wants gradients of (frozen ones
    // and absent biases stay plain tensors).
    std::vector<at::Tensor> params, sums(6);
    for (int i = 1; i <= 6; ++i) {
      const bool wanted = saved[i].numel() > 0 && ctx->needs_input_grad(i);
      params.push_back(wanted ? saved[i].detach().requires_grad_() : saved[i].detach());
    }
    for (int64_t start = 0; start < flat.size(0); start += chunk) {
      const int64_t len = std::min(chunk, flat.size(0) - start);
      c10::AutoGradMode grad_mode(true);
      auto x = flat.narrow(0, start, len).detach().requires_grad_();
      std::vector<at::Tensor> inputs = {x};
      for (const auto& t : params)
        if (t.requires_grad()) inputs.push_back(t);
      const auto g = torch::autograd::grad({body(x, params)}, inputs, {grad.narrow(0, start, len)});
      grad_x.narrow(0, start, len).copy_(g[0]);
      size_t k = 1;
      for (int i = 0; i < 6; ++i) {
        if (!params[i].requires_grad()) continue;
        sums[i] = sums[i].defined() ? sums[i].add_(g[k])
                                    : g[k].to(at::promote_types(g[k].scalar_type(), at::kFloat));
        ++k;
      }
    }
    torch::autograd::variable_list out = {grad_x.view(saved[0].sizes())};
    for (int i = 0; i < 6; ++i)
      out.push_back(sums[i].defined() ? sums[i].to(saved[i + 1].scalar_type()) : at::Tensor());
    out.push_back(at::Tensor());  // chunk
    return out;
  }
};

struct MLPImpl : torch::nn::Cloneable<MLPImpl> {
  CausalLMConfig config;
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  int64_t chunk_tokens = 0;  // > 0: longer inputs go by TokenChunkedMLP
  LoraOptions lora;
  MLPImpl(CausalLMConfig c, LoraOptions l) : config(std::move(c)), lora(std::move(l)) { reset(); }
  void reset() override {
    const auto& c = config;
    gate_proj = register_module("gate_proj", make_linear(c.hidden_size, c.intermediate_size,
                                                         c.mlp_bias, lora, "gate_proj"));
    up_proj = register_module(
        "up_proj", make_linear(c.hidden_size, c.intermediate_size, c.mlp_bias, lora, "up_proj"));
    down_proj = register_module("down_proj", make_linear(c.intermediate_size, c.hidden_size,
                                                         c.mlp_bias, lora, "down_proj"));
  }
  at::Tensor forward(const at::Tensor& x) {
    // With or without grad: without, the function keeps nothing and its
    // chunks alone bound the intermediates.
    if (chunk_tokens > 0 && x.numel() / x.size(-1) > chunk_tokens)
      return TokenChunkedMLP::apply(
          x, gate_proj->weight, TokenChunkedMLP::no_bias_if_absent(gate_proj->bias),
          up_proj->weight, TokenChunkedMLP::no_bias_if_absent(up_proj->bias), down_proj->weight,
          TokenChunkedMLP::no_bias_if_absent(down_proj->bias), chunk_tokens);
    return down_proj(ops::swiglu(gate_proj(x), up_proj(x)));
  }
};
TORCH_MODULE(MLP);

// Qwen3-MoE's sparse MLP, with transformers 5's parameters: the router
// "gate.weight" [experts, hidden] and the experts' stacked projections
// "experts.gate_up_proj" [experts, 2 x intermediate, hidden] (gate rows
// first) and "experts.down_proj" [experts, hidden, intermediate].
//
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
at::Tensor stacked_out_in(const at::Tensor& weight, bool gpt_oss) {
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
struct MoeExpertsImpl : torch::nn::Cloneable<MoeExpertsImpl> {
  int64_t experts, hidden, intermediate;
  bool gpt_oss;  // Note [GPT-OSS]
  LoraOptions lora;
  at::Tensor gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias;
  LoraFactors gate_up_lora{nullptr}, down_lora{nullptr};  // Note [Expert LoRA]
  MoeExpertsImpl(int64_t e, int64_t h, int64_t i, bool gpt_oss_layout, LoraOptions l)
      : experts(e), hidden(h), intermediate(i), gpt_oss(gpt_oss_layout), lora(std::move(l)) {
    reset();
  }
  void reset() override {
    if (gpt_oss) {
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
  // The tensors ExpertMath computes with, in its order (absent: empty).
  std::vector<at::Tensor> tensors() const {
    const auto none = at::empty({0});
    auto or_none = [&](const at::Tensor& t) { return t.defined() ? t : none; };
    auto factor = [&](const LoraFactors& f, bool b) {
      return f ? (b ? f->lora_B->weight : f->lora_A->weight) : none;
    };
    return {gate_up_proj,
            down_proj,
            or_none(gate_up_proj_bias),
            or_none(down_proj_bias),
            factor(gate_up_lora, false),
            factor(gate_up_lora, true),
            factor(down_lora, false),
            factor(down_lora, true)};
  }
};
TORCH_MODULE(MoeExperts);

// Note [Expert routing]
// As transformers: router logits in the model's dtype, a float softmax,
// the top num_experts_per_tok probabilities (renormalised with
// norm_topk_prob) cast back to the logits' dtype; each chosen expert's
// SwiGLU output times its weight, added into the token's output. Here the
// (token, choice) pairs are sorted by expert (a stable sort: the order is
// the same on every run), the experts run over their contiguous rows, and
// index_add puts the weighted rows back. The routing is a function of the
// layer's input alone, so the recompute of a backward stage routes exactly
// as the forward did.
//
// The experts run as one grouped matrix product per projection
// (at::_grouped_mm: rows [N, in] against the stacked weights [E, in, out],
// split at each expert's end offset, computed on the device by a binary
// search of the sorted expert ids: no host round trip, no per-expert
// launch on Hopper and later with bf16, where LibTorch has a grouped
// kernel; elsewhere it loops inside LibTorch). Where _grouped_mm refuses
// the shapes (its rows must be 16-byte aligned) or set_grouped_experts is
// off, a loop of one product per expert over row counts read on the host
// once per layer call; the rows are cut with one split (whose backward is
// one concatenation: a narrow per expert would add an [N, in] zero tensor
// per expert to the backward).
bool grouped_mm_takes(const at::Tensor& rows, int64_t in, int64_t out) {
  const auto st = rows.scalar_type();
  if (st != at::kFloat && st != at::kBFloat16 && st != at::kHalf) return false;
  const int64_t bytes = static_cast<int64_t>(c10::elementSize(st));
  return (in * bytes) % 16 == 0 && (out * bytes) % 16 == 0;
}

// Where each expert's rows end in the sorted rows: on the device for the
// grouped product, on the host (read once, when a loop first needs it).
struct ExpertRows {
  at::Tensor ends;  // [E] int32
  std::vector<int64_t> sizes;
  const std::vector<int64_t>& host_sizes() {
    if (sizes.empty()) {
      const auto host = ends.to(at::kCPU, at::kLong);
      const auto* end = host.data_ptr<int64_t>();
      for (int64_t e = 0, start = 0; e < host.numel(); start = end[e++])
        sizes.push_back(end[e] - start);
    }
    return sizes;
  }
};

// rows [N, in] sorted by expert, weight [E, out, in].
at::Tensor expert_matmul(const at::Tensor& rows, const at::Tensor& weight, ExpertRows& split,
                         bool grouped) {
  if (grouped) return at::_grouped_mm(rows, weight.transpose(1, 2), split.ends);
  const auto parts = rows.split_with_sizes(split.host_sizes());
  std::vector<at::Tensor> outs;
  for (size_t e = 0; e < parts.size(); ++e)
    if (parts[e].size(0) > 0) outs.push_back(at::linear(parts[e], weight[e]));
  if (outs.empty()) return at::zeros({0, weight.size(1)}, rows.options());
  return at::cat(outs);
}

// The experts' arithmetic on given tensors (MoeExperts::tensors() order),
// apart from the module, so that TokenChunkedExperts can recompute it on
// leaf copies in its backward.
struct ExpertMath {
  enum { kGateUp, kDown, kGateUpBias, kDownBias, kGateUpA, kGateUpB, kDownA, kDownB };
  int64_t experts = 0;
  bool gpt_oss = false;  // Note [GPT-OSS]
  double swiglu_limit = 0;
  bool grouped = true;
  double gate_up_scaling = 0, down_scaling = 0;  // the adapters'

  // One stacked projection of the sorted rows (expert_of: each row's
  // expert), with its bias and adapter where it has them.
  at::Tensor project(const at::Tensor& rows, const at::Tensor& stacked, const at::Tensor& bias,
                     const at::Tensor& A, const at::Tensor& B, double scaling, ExpertRows& split,
                     const at::Tensor& expert_of) const {
    const auto weight = stacked_out_in(stacked, gpt_oss);
    const int64_t in = weight.size(2), out = weight.size(1);
    auto y = expert_matmul(rows, weight, split, grouped && grouped_mm_takes(rows, in, out));
    if (bias.numel() > 0) y = y + bias.index_select(0, expert_of);
    if (A.numel() == 0) return y;
    const int64_t rank = A.size(0) / experts;
    const bool group =
        grouped && grouped_mm_takes(rows, in, rank) && grouped_mm_takes(rows, rank, out);
    const auto dtype = rows.scalar_type();
    const auto low = expert_matmul(rows, LoraFactorsImpl::a_of(A, experts, dtype), split, group);
    return at::add(y, expert_matmul(low, LoraFactorsImpl::b_of(B, experts, dtype), split, group),
                   scaling);
  }

  // flat [N, hidden], top_e [N, k] (the chosen experts), weights [N, k]:
  // sum_j weights[n, j] expert_{top_e[n, j]}(flat[n]).
  at::Tensor forward(const at::Tensor& flat, const at::Tensor& top_e, const at::Tensor& weights,
                     at::TensorList t) const {
    const int64_t k = top_e.size(1);
    const auto expert_of = top_e.reshape({-1});
    const auto order = at::argsort(expert_of, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const auto token_of = at::div(order, k, "floor");
    const auto sorted_experts = expert_of.index_select(0, order);
    ExpertRows split{at::searchsorted(sorted_experts, at::arange(experts, expert_of.options()),
                                      /*out_int32=*/true, /*right=*/true)};
    const auto rows = flat.index_select(0, token_of);
    const auto gate_up = project(rows, t[kGateUp], t[kGateUpBias], t[kGateUpA], t[kGateUpB],
                                 gate_up_scaling, split, sorted_experts);
    at::Tensor act;
    if (gpt_oss) {  // Note [GPT-OSS]
      const auto g = gate_up.slice(-1, 0, c10::nullopt, 2).clamp_max(swiglu_limit);
      const auto up = gate_up.slice(-1, 1, c10::nullopt, 2).clamp(-swiglu_limit, swiglu_limit);
      act = ((up + 1) * (g * at::sigmoid(g * 1.702))).contiguous();
    } else {
      const auto parts = gate_up.chunk(2, -1);
      act = ops::swiglu(parts[0], parts[1]).contiguous();
    }
    const auto out = project(act, t[kDown], t[kDownBias], t[kDownA], t[kDownB], down_scaling, split,
                             sorted_experts);
    const auto weighted = out * weights.reshape({-1}).index_select(0, order).unsqueeze(-1);
    return at::zeros_like(flat).index_add_(0, token_of, weighted);
  }

  void save(torch::autograd::AutogradContext* ctx) const {
    ctx->saved_data["experts"] = experts;
    ctx->saved_data["gpt_oss"] = gpt_oss;
    ctx->saved_data["swiglu_limit"] = swiglu_limit;
    ctx->saved_data["grouped"] = grouped;
    ctx->saved_data["gate_up_scaling"] = gate_up_scaling;
    ctx->saved_data["down_scaling"] = down_scaling;
  }
  static ExpertMath load(torch::autograd::AutogradContext* ctx) {
    auto& d = ctx->saved_data;
    return {d["experts"].toInt(),  d["gpt_oss"].toBool(),           d["swiglu_limit"].toDouble(),
            d["grouped"].toBool(), d["gate_up_scaling"].toDouble(), d["down_scaling"].toDouble()};
  }
};

// Note [Expert token chunks]
// A long sequence's sparse MLP holds k rows per token (Qwen3-235B-A22B at
// 31K tokens: 254K rows; their gathered inputs, projections and
// activations come to 6.5 GB, more than the layer's 4.7 GB of weights).
// Like TokenChunkedMLP, beyond expert_chunk_tokens tokens the experts run
// chunk by chunk of tokens, the forward keeping only its inputs (the
// tokens, their chosen experts and weights) and the backward recomputing
// one chunk at a time: the experts' activation memory is bounded by the
// chunk, for one more forward of the experts. The routing is computed once,
// outside (its probabilities' gradient comes back through the weights), so
// the recomputed chunks route as the forward did.
struct TokenChunkedExperts : torch::autograd::Function<TokenChunkedExperts> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& flat,
                            const at::Tensor& top_e, const at::Tensor& weights, at::TensorList t,
                            int64_t chunk, const ExpertMath& math) {
    auto out = at::empty_like(flat);
    for (int64_t start = 0; start < flat.size(0); start += chunk) {
      const int64_t len = std::min(chunk, flat.size(0) - start);
      out.narrow(0, start, len)
          .copy_(math.forward(flat.narrow(0, start, len), top_e.narrow(0, start, len),
                              weights.narrow(0, start, len), t));
    }
    std::vector<at::Tensor> saved = {flat, top_e, weights};
    saved.insert(saved.end(), t.begin(), t.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["chunk"] = chunk;
    math.save(ctx);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const auto math = ExpertMath::load(ctx);
    const auto &flat = saved[0], &top_e = saved[1], &weights = saved[2];
    const auto& grad = grads[0];
    const size_t T = saved.size() - 3;
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(2);
    at::Tensor grad_x = want_x ? at::empty_like(flat) : at::Tensor();
    at::Tensor grad_w = want_w ? at::empty_like(weights) : at::Tensor();
    // Leaves for the tensors autograd wants gradients of; their gradients
    // add up over chunks in float32 (or wider).
    std::vector<at::Tensor> t, sums(T);
    for (size_t i = 0; i < T; ++i) {
      const auto& v = saved[3 + i];
      t.push_back(v.numel() > 0 && ctx->needs_input_grad(3 + i) ? v.detach().requires_grad_()
                                                                : v.detach());
    }
    for (int64_t start = 0; start < flat.size(0); start += chunk) {
      const int64_t len = std::min(chunk, flat.size(0) - start);
      c10::AutoGradMode grad_mode(true);
      auto x = flat.narrow(0, start, len).detach().requires_grad_(want_x);
      auto w = weights.narrow(0, start, len).detach().requires_grad_(want_w);
      std::vector<at::Tensor> inputs;
      if (want_x) inputs.push_back(x);
      if (want_w) inputs.push_back(w);
      for (const auto& v : t)
        if (v.requires_grad()) inputs.push_back(v);
      if (inputs.empty()) break;
      const auto y = math.forward(x, top_e.narrow(0, start, len), w, t);
      const auto g = torch::autograd::grad({y}, inputs, {grad.narrow(0, start, len)},
                                           /*retain_graph=*/false, /*create_graph=*/false,
                                           /*allow_unused=*/true);
      size_t next = 0;
      auto take = [&](at::Tensor& into) {
        const auto& gi = g[next++];
        if (gi.defined())
          into.narrow(0, start, len).copy_(gi);
        else
          into.narrow(0, start, len).zero_();
      };
      if (want_x) take(grad_x);
      if (want_w) take(grad_w);
      for (size_t i = 0; i < T; ++i) {
        if (!t[i].requires_grad()) continue;
        const auto& gi = g[next++];
        if (!gi.defined()) continue;
        sums[i] = sums[i].defined() ? sums[i].add_(gi)
                                    : gi.to(at::promote_types(gi.scalar_type(), at::kFloat));
      }
    }
    torch::autograd::variable_list out = {grad_x, at::Tensor(), grad_w};
    for (size_t i = 0; i < T; ++i)
      out.push_back(sums[i].defined() ? sums[i].to(saved[3 + i].scalar_type()) : at::Tensor());
    out.push_back(at::Tensor());  // chunk
    out.push_back(at::Tensor());  // math
    return out;
  }
};

// Note [Router load-balancing loss]
// transformers' load_balancing_loss_func (Switch Transformer's loss): over
// the sparse layers' tokens (those the attention mask keeps), with f_e the
// fraction of top-k assignments that go to expert e and P_e the mean
// router probability of e, both averaged over every sparse layer's tokens
// together, aux = E * sum_e f_e P_e, and the loss gains
// router_aux_loss_coef * aux. Layers sum into one carried statistic,
// [assignment counts (E), probability sums (E), tokens (1)], a float
// tensor appended to the decoder tuple; the output adapter forms aux from
// it. Its gradient reaches each router through the probability sums (the
// counts are constants), so the pipeline's stage boundaries carry it like
// the hidden state.
//
// The statistic is a microbatch's own: f is only known once every layer
// has routed the tokens, and a microbatch's backward starts before the
// next one's forward is done. A microbatch's aux is weighted like its
// cross-entropy: by its labelled tokens over num_items_in_batch where that
// is given (the microbatches' weights then add up to 1 for the batch),
// else 1 (each microbatch's loss is then its own mean as well). With one
// microbatch this is transformers' loss exactly; with several it is
// Megatron's micro-batch load balancing. Splitting a microbatch into row
// chunks would change the statistic: layers carrying it do not split rows.
at::Tensor router_statistics(const at::Tensor& probs, const at::Tensor& top_e,
                             const std::optional<SequenceLayout>& layout) {
  auto p = probs, e = top_e;
  if (layout) {
    p = p.index_select(0, layout->token_index);
    e = e.index_select(0, layout->token_index);
  }
  const int64_t E = probs.size(1);
  const auto chosen = e.reshape({-1});
  auto counts = at::zeros({E}, p.options().requires_grad(false))
                    .index_add_(0, chosen, at::ones({chosen.numel()}, p.options()));
  const auto tokens = at::full({1}, static_cast<double>(p.size(0)), p.options());
  return at::cat({counts, p.sum(0), tokens});
}

at::Tensor router_aux_loss(const at::Tensor& stats) {
  const int64_t E = (stats.size(0) - 1) / 2;
  const auto tokens = stats.narrow(0, 2 * E, 1).clamp_min(1);
  return (stats.narrow(0, 0, E) / tokens * (stats.narrow(0, E, E) / tokens)).sum() *
         static_cast<double>(E);
}

struct SparseMoeImpl : torch::nn::Cloneable<SparseMoeImpl> {
  CausalLMConfig config;
  bool grouped;
  int64_t chunk_tokens;  // > 0: longer inputs go by TokenChunkedExperts
  LoraOptions lora;
  BareWeight gate{nullptr};  // the router (Qwen3-MoE)
  Linear router{nullptr};    // GPT-OSS's, with a bias
  MoeExperts experts{nullptr};
  SparseMoeImpl(CausalLMConfig c, bool grouped_experts, int64_t chunk, LoraOptions l)
      : config(std::move(c)), grouped(grouped_experts), chunk_tokens(chunk), lora(std::move(l)) {
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
                              config.gpt_oss_experts, lora));
  }
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    return copy_module(*this, [&] {
      return std::make_shared<SparseMoeImpl>(config, grouped, chunk_tokens, lora);
    });
  }
  ExpertMath math() const {
    ExpertMath m;
    m.experts = config.num_experts;
    m.gpt_oss = config.gpt_oss_experts;
    m.swiglu_limit = config.swiglu_limit;
    m.grouped = grouped;
    if (experts->gate_up_lora) m.gate_up_scaling = experts->gate_up_lora->scaling;
    if (experts->down_lora) m.down_scaling = experts->down_lora->scaling;
    return m;
  }
  // The layer's output; with `stats`, its router statistics added into it
  // (Note [Router load-balancing loss]).
  at::Tensor forward(const at::Tensor& x, const std::optional<SequenceLayout>& layout = {},
                     at::Tensor* stats = nullptr) {
    const int64_t k = config.num_experts_per_tok;
    const auto flat = x.reshape({-1, x.size(-1)});
    const auto logits = router ? router(flat) : at::linear(flat, gate->weight);
    const auto probs = at::softmax(logits, -1, at::kFloat);
    auto [top_p, top_e] = at::topk(probs, k, -1);
    if (stats) *stats = *stats + router_statistics(probs, top_e, layout);
    if (config.norm_topk_prob) top_p = top_p / top_p.sum(-1, /*keepdim=*/true);
    const auto weights = top_p.to(logits.scalar_type());
    const auto tensors = experts->tensors();
    // With or without grad: without, the chunks alone bound the
    // intermediates (Note [Expert token chunks]).
    if (chunk_tokens > 0 && flat.size(0) > chunk_tokens)
      return TokenChunkedExperts::apply(flat, top_e, weights, at::TensorList(tensors), chunk_tokens,
                                        math())
          .view(x.sizes());
    return math().forward(flat, top_e, weights, tensors).view(x.sizes());
  }
};
TORCH_MODULE(SparseMoe);

// The decoder layers' and output adapter's input (the input adapter's
// output tuple) in chunks of rows (Note [Tail row chunks], layer.h). Only
// with labels (the output is then the loss, a sum over tokens divided by
// num_items_in_batch, plus the logits if asked): each chunk gets the
// microbatch's count as its divisor where none was given, so that the
// chunks' losses add up to the microbatch's mean. A layout's sequences lie
// within rows, rows in order: a chunk takes those of its rows, rebased.
std::vector<c10::IValue> split_decoder_input_rows(const c10::IValue& input,
                                                  const std::vector<int64_t>& rows) {
  if (!input.isTuple()) return {};
  const auto& e = input.toTupleRef().elements();
  if (e.size() != 7 || !e[0].isTensor() || !e[4].isTensor()) return {};
  const auto hidden = e[0].toTensor();
  const auto labels = e[4].toTensor();
  const int64_t B = hidden.size(0), T = hidden.size(1);
  if (labels.dim() != 2 || labels.size(0) != B) return {};
  c10::IValue divisor = e[6];
  if (!divisor.isDouble()) {
    const int64_t count = count_loss_tokens(labels);
    if (count == 0) return {};
    divisor = static_cast<double>(count);
  }
  const auto layout = SequenceLayout::from_ivalue(e[3]);
  std::vector<int64_t> cu;         // the layout's sequence offsets
  std::vector<int64_t> row_begin;  // per row (and B): its first sequence
  if (layout) {
    if (!layout->token_index.device().is_cpu() || !layout->cu_seqlens.device().is_cpu()) return {};
    const auto index = layout->token_index.contiguous();
    const auto offsets = layout->cu_seqlens.to(at::kLong).contiguous();
    const auto* idx = index.data_ptr<int64_t>();
    cu.assign(offsets.data_ptr<int64_t>(), offsets.data_ptr<int64_t>() + offsets.numel());
    const int64_t S = static_cast<int64_t>(cu.size()) - 1;
    row_begin.assign(B + 1, S);
    int64_t next_row = B;  // the row of sequence s + 1
    for (int64_t s = S - 1; s >= 0; --s) {
      if (cu[s + 1] <= cu[s]) return {};
      const int64_t row = idx[cu[s]] / T;
      if (row < 0 || row >= B || row > next_row || idx[cu[s + 1] - 1] / T != row)
        return {};  // a sequence across rows, or rows out of order
      for (int64_t r = row; r >= 0 && row_begin[r] > s; --r) row_begin[r] = s;
      next_row = row;
    }
  }
  std::vector<c10::IValue> chunks;
  int64_t r0 = 0;
  for (const int64_t n : rows) {
    auto rows_of = [&](const c10::IValue& v) -> c10::IValue {
      if (!v.isTensor()) return v;
      const auto t = v.toTensor();
      return t.dim() > 0 && t.size(0) == B ? c10::IValue(t.narrow(0, r0, n)) : v;
    };
    c10::IValue chunk_layout;
    if (layout) {
      const int64_t s0 = row_begin[r0], s1 = row_begin[r0 + n];
      SequenceLayout part;
      part.token_index = layout->token_index.narrow(0, cu[s0], cu[s1] - cu[s0]) - r0 * T;
      std::vector<int32_t> offsets;
      for (int64_t s = s0; s <= s1; ++s) {
        offsets.push_back(static_cast<int32_t>(cu[s] - cu[s0]));
        if (s > s0) part.max_seqlen = std::max(part.max_seqlen, cu[s] - cu[s - 1]);
      }
      part.cu_seqlens = at::tensor(offsets, layout->cu_seqlens.options());
      chunk_layout = part.to_ivalue();
    }
    chunks.push_back(c10::ivalue::Tuple::create(
        {rows_of(e[0]), rows_of(e[1]), rows_of(e[2]), chunk_layout, rows_of(e[4]), e[5], divisor}));
    r0 += n;
  }
  TORCH_CHECK(r0 == B, "split_decoder_input_rows: the chunks' rows add up to ", r0,
              ", the input has ", B);
  return chunks;
}

struct DecoderLayerImpl : torch::nn::Cloneable<DecoderLayerImpl>, SplitsInputRows {
  CausalLMConfig config;
  int64_t mlp_chunk_tokens, expert_chunk_tokens;
  int64_t index;  // which layer: its attention window
  bool grouped_experts;
  Attention self_attn{nullptr};
  MLP mlp{nullptr};        // a dense layer's
  SparseMoe moe{nullptr};  // a sparse one's (registered as "mlp", as transformers names it)
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LoraOptions lora;
  DecoderLayerImpl(CausalLMConfig c, int64_t mlp_chunk, int64_t expert_chunk, int64_t layer,
                   bool grouped, LoraOptions l)
      : config(std::move(c)),
        mlp_chunk_tokens(mlp_chunk),
        expert_chunk_tokens(expert_chunk),
        index(layer),
        grouped_experts(grouped),
        lora(std::move(l)) {
    reset();
  }
  void reset() override {
    self_attn =
        register_module("self_attn", Attention(config, config.attention_window(index), lora));
    if (config.sparse_layer(index)) {
      moe = register_module("mlp", SparseMoe(config, grouped_experts, expert_chunk_tokens, lora));
    } else {
      mlp = register_module("mlp", MLP(config, lora));
      // (The token-chunked MLP takes the base weights only.)
      const bool mlp_lora = lora.rank > 0 && (lora.targets_projection("gate_proj") ||
                                              lora.targets_projection("up_proj") ||
                                              lora.targets_projection("down_proj"));
      mlp->chunk_tokens = mlp_lora ? 0 : mlp_chunk_tokens;
    }
    input_layernorm =
        register_module("input_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps));
    post_attention_layernorm = register_module("post_attention_layernorm",
                                               RMSNorm(config.hidden_size, config.rms_norm_eps));
  }
  c10::IValue forward(c10::IValue input) {
    const auto& e = input.toTupleRef().elements();
    auto h = e[0].toTensor();
    const auto layout = SequenceLayout::from_ivalue(e[3]);
    h = h + self_attn(input_layernorm(h), e[1].toTensor(), e[2].toTensor(), layout);
    const auto normed = post_attention_layernorm(h);
    at::Tensor stats = e.size() > 7 && e[7].isTensor() ? e[7].toTensor() : at::Tensor();
    h = h + (moe ? moe(normed, layout, stats.defined() ? &stats : nullptr) : mlp(normed));
    // Everything but the hidden state and the router statistics passes on.
    std::vector<c10::IValue> out(e.begin(), e.end());
    out[0] = h;
    if (stats.defined()) out[7] = stats;
    return c10::ivalue::Tuple::create(std::move(out));
  }
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    return copy_module(*this, [&] {
      return std::make_shared<DecoderLayerImpl>(config, mlp_chunk_tokens, expert_chunk_tokens,
                                                index, grouped_experts, lora);
    });
  }
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    return split_decoder_input_rows(input, rows);
  }
  // LoRA dropout draws random numbers: a row chunk would draw others; the
  // router statistics are the whole microbatch's.
  bool splits_rows() const override {
    return (lora.rank == 0 || lora.dropout == 0) && !config.router_loss();
  }
};
TORCH_MODULE(DecoderLayer);

// Final norm, lm_head and the loss. With tied embeddings the lm_head weight
// is the input adapter's embedding tensor (registered here as "tied_weight",
// so RoundPipe sees one parameter used by two layers).
struct OutputAdapterImpl : torch::nn::Cloneable<OutputAdapterImpl>, SplitsInputRows {
  CausalLMConfig config;
  CausalLMOptions options;
  at::Tensor tied;  // the embedding weight when tied, else undefined
  RMSNorm norm{nullptr};
  Linear lm_head{nullptr};  // untied
  at::Tensor weight;        // lm_head's weight, or the tied embedding
  OutputAdapterImpl(CausalLMConfig c, CausalLMOptions o, at::Tensor tied_weight)
      : config(std::move(c)), options(o), tied(std::move(tied_weight)) {
    reset();
  }
  void reset() override {
    norm = register_module("norm", RMSNorm(config.hidden_size, config.rms_norm_eps));
    if (tied.defined()) {
      weight = register_parameter("tied_weight", tied);
    } else {
      lm_head =
          register_module("lm_head", make_linear(config.hidden_size, config.vocab_size, false));
      weight = lm_head->weight;
    }
  }
  // The copy gets tensors of its own (RoundPipe binds device copies into it).
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override {
    return copy_module(*this, [&] {
      return std::make_shared<OutputAdapterImpl>(
          config, options,
          tied.defined() ? at::empty(tied.sizes(), tied.options()).requires_grad_() : at::Tensor());
    });
  }
  c10::IValue forward(c10::IValue input) {
    const auto& e = input.toTupleRef().elements();
    auto h = norm(e[0].toTensor());
    if (!e[4].isTensor()) return at::linear(h, weight);
    // HuggingFace's loss: labels shifted left, -100 ignored, summed and
    // divided by num_items_in_batch when given (the whole batch's count, so
    // that microbatch losses add up to the batch's mean), else by this
    // microbatch's own count.
    auto labels = e[4].toTensor();
    auto shifted = at::constant_pad_nd(labels, {0, 1}, -100).narrow(1, 1, labels.size(1));
    const int64_t D = h.size(-1);
    const bool return_logits =
        e.size() > 5 && e[5].isBool() ? e[5].toBool() : options.return_logits;
    const std::optional<double> divisor =
        e.size() > 6 && e[6].isDouble() ? std::optional<double>(e[6].toDouble()) : std::nullopt;
    // Note [Router load-balancing loss]: weighted like the cross-entropy.
    at::Tensor router_loss;
    if (e.size() > 7 && e[7].isTensor()) {
      router_loss = router_aux_loss(e[7].toTensor()) * config.router_aux_loss_coef;
      if (divisor)  // (the labelled tokens counted on the device: no host round trip)
        router_loss = router_loss * shifted.ne(-100).sum().to(router_loss.scalar_type()) / *divisor;
    }
    auto plus_router_loss = [&](const at::Tensor& loss) {
      return router_loss.defined() ? loss + router_loss.to(loss.scalar_type()) : loss;
    };
    if (!return_logits) {
      return plus_router_loss(chunked_linear_cross_entropy(
          h.reshape({-1, D}), weight, shifted.reshape({-1}), options.loss_chunk_tokens, divisor));
    }
    auto logits = at::linear(h, weight);
    const auto flat = logits.to(at::kFloat).reshape({-1, logits.size(-1)});
    auto loss =
        divisor
            ? at::cross_entropy_loss(flat, shifted.reshape({-1}), {}, at::Reduction::Sum, -100)
                  .div(*divisor)
            : at::cross_entropy_loss(flat, shifted.reshape({-1}), {}, at::Reduction::Mean, -100);
    return c10::ivalue::Tuple::create({plus_router_loss(loss), logits});
  }
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    return split_decoder_input_rows(input, rows);
  }
  bool splits_rows() const override { return !config.router_loss(); }
};
TORCH_MODULE(OutputAdapter);

// ---------------------------------------------------------------- IO

std::map<std::string, std::string> weight_files(const fs::path& dir) {
  std::map<std::string, std::string> files;  // tensor name -> file
  const auto index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream in(index);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, index.string(), " is not valid JSON: ", e.what());
    }
    TORCH_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), index.string(),
                " has no weight_map");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      TORCH_CHECK(it->is_string(), index.string(), ": weight_map['", it.key(),
                  "'] is not a file name");
      // A plain name in this directory: an index must not reach elsewhere.
      const fs::path file(it->get<std::string>());
      TORCH_CHECK(!file.empty() && file == file.filename() && file != "." && file != "..",
                  index.string(), ": weight_map['", it.key(), "'] = '", file.string(),
                  "' is not a file name in ", dir.string());
      files[it.key()] = (dir / file).string();
    }
    return files;
  }
  const auto single = dir / "model.safetensors";
  TORCH_CHECK(fs::exists(single), "no weights in ", dir.string(),
              ": expected model.safetensors or model.safetensors.index.json");
  files[""] = single.string();
  return files;
}

}  // namespace

c10::IValue CausalLMInput::to_ivalue() const {
  auto tensor = [](const at::Tensor& t) { return t.defined() ? c10::IValue(t) : c10::IValue(); };
  auto optional = [](const auto& v) { return v ? c10::IValue(*v) : c10::IValue(); };
  // An all-ones mask masks nothing: left out here, on the host, the devices
  // never read it back (with position_ids it stays: transformers then does
  // not split packed documents, and neither does sequence_layout).
  const bool mask_masks_nothing = attention_mask.defined() && attention_mask.is_cpu() &&
                                  !position_ids.defined() &&
                                  attention_mask.ne(0).all().item<bool>();
  const at::Tensor mask = mask_masks_nothing ? at::Tensor() : attention_mask;
  std::vector<c10::IValue> elements{tensor(input_ids),    tensor(mask),
                                    tensor(labels),       optional(return_logits),
                                    tensor(position_ids), optional(num_items_in_batch)};
  if (inputs_embeds.defined()) elements.emplace_back(inputs_embeds);
  return c10::ivalue::Tuple::create(std::move(elements));
}

double LoraOptions::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / rank;
}

bool LoraOptions::targets_projection(const std::string& projection) const {
  if (rank <= 0 || projection.empty()) return false;
  if (targets.empty()) return target_parameters.empty();
  return std::find(targets.begin(), targets.end(), projection) != targets.end() ||
         std::find(targets.begin(), targets.end(), "all-linear") != targets.end();
}

namespace {
// Whether `target` names the stacked expert weight `weight` as peft
// matches target_parameters: the whole "mlp.experts.<weight>" or an
// ending of it at a dot.
bool names_expert_weight(const std::string& target, const std::string& weight) {
  const std::string full = "mlp.experts." + weight;
  if (target.empty() || target.size() > full.size()) return false;
  const size_t at = full.size() - target.size();
  return full.compare(at, target.size(), target) == 0 && (at == 0 || full[at - 1] == '.');
}
}  // namespace

LoraOptions LoraOptions::for_experts(const std::string& weight) const {
  LoraOptions o = *this;
  if (auto it = expert_rank.find(weight); it != expert_rank.end()) o.rank = it->second;
  if (auto it = expert_alpha.find(weight); it != expert_alpha.end()) o.alpha = it->second;
  return o;
}

bool LoraOptions::targets_experts(const std::string& weight) const {
  if (rank <= 0) return false;
  return std::any_of(target_parameters.begin(), target_parameters.end(),
                     [&](const std::string& t) { return names_expert_weight(t, weight); });
}

bool CausalLM::is_lora_name(const std::string& hf_name) {
  return hf_name.find(".lora_A.") != std::string::npos ||
         hf_name.find(".lora_B.") != std::string::npos;
}

int64_t count_loss_tokens(const at::Tensor& labels) {
  TORCH_CHECK(labels.dim() == 2, "labels must be [batch, sequence], got ", labels.sizes());
  return labels.narrow(1, 1, labels.size(1) - 1).ne(-100).sum().item<int64_t>();
}

CausalLM::CausalLM(CausalLMConfig config, CausalLMOptions options)
    : config_(std::move(config)), options_(options) {
  InputAdapter input(config_);
  sequential_->push_back(input);
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i)
    sequential_->push_back(DecoderLayer(config_, options_.mlp_chunk_tokens,
                                        options_.expert_chunk_tokens, i, options_.grouped_experts,
                                        options_.lora));
  sequential_->push_back(OutputAdapter(
      config_, options_, config_.tie_word_embeddings ? input->embed_tokens->weight : at::Tensor()));
  c10::NoGradGuard no_grad;
  const auto& lora = options_.lora;
  if (lora.rank > 0) {
    static const std::set<std::string> known = {"q_proj",    "k_proj",  "v_proj",    "o_proj",
                                                "gate_proj", "up_proj", "down_proj", "all-linear"};
    for (const auto& t : lora.targets)
      TORCH_CHECK(known.count(t), "LoRA target '", t, "' is not a projection of the ",
                  config_.model_type,
                  " preset: name q_proj, k_proj, v_proj, o_proj, gate_proj, "
                  "up_proj, down_proj, or all-linear");
    TORCH_CHECK(lora.dropout >= 0 && lora.dropout < 1, "LoRA dropout must be in [0, 1), got ",
                lora.dropout);
    for (const auto& t : lora.target_parameters)
      TORCH_CHECK(names_expert_weight(t, "gate_up_proj") || names_expert_weight(t, "down_proj"),
                  "LoRA target parameter '", t,
                  "' is not an expert weight of the presets: name mlp.experts.gate_up_proj or "
                  "mlp.experts.down_proj");
    TORCH_CHECK(lora.target_parameters.empty() || config_.num_experts > 0,
                "LoRA targets the "
                "experts' weights, but this ",
                config_.model_type,
                " model has no experts: leave "
                "target_parameters empty");
    TORCH_CHECK(lora.target_parameters.empty() || lora.dropout == 0,
                "LoRA on the experts' weights (target_parameters) takes no dropout, as in peft: "
                "set the dropout to 0");
  }
  if (!options_.init_weights) {
    // Uninitialised, in the model dtype, memory untouched (rotary tables stay fp32).
    for (auto& p : sequential_->parameters())
      p.set_data(at::empty(p.sizes(), p.options().dtype(options_.dtype)));
    init_lora();
    return;
  }
  // transformers' initialisation for new weights: normal(0, 0.02), norms 1.
  for (auto& item : sequential_->named_parameters()) {
    const auto& name = item.key();
    if (name.size() >= 5 && name.substr(name.size() - 5) == ".bias") {
      item.value().zero_();
    } else if (name.find("norm") == std::string::npos) {
      item.value().normal_(0, 0.02);
    }
  }
  sequential_->to(options_.dtype);
  input->inv_freq.set_data(inverse_frequencies(config_));  // rotary tables stay fp32
  init_lora();
  if (options_.pin_memory) {
    // Tied weights are one tensor: pin each once.
    std::set<const c10::TensorImpl*> done;
    for (auto& p : sequential_->parameters()) {
      if (done.insert(p.unsafeGetTensorImpl()).second) p.set_data(p.pin_memory());
    }
  }
}

// LoRA adapters start as peft's: A as nn.Linear's weight (kaiming-uniform,
// a = sqrt(5): uniform(+-1/sqrt(in))), B zero, so the model starts as the
// base; every other parameter is frozen.
void CausalLM::init_lora() {
  if (options_.lora.rank <= 0) return;
  c10::NoGradGuard no_grad;
  for (auto& item : sequential_->named_parameters()) {
    auto& p = item.value();
    const auto& name = item.key();
    const auto dtype = options_.lora.dtype.value_or(options_.dtype);
    if (name.find("lora_A.") != std::string::npos) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(p.size(1)));
      p.set_data(at::empty(p.sizes(), p.options().dtype(dtype)).uniform_(-bound, bound));
    } else if (name.find("lora_B.") != std::string::npos) {
      p.set_data(at::zeros(p.sizes(), p.options().dtype(dtype)));
    } else {
      p.requires_grad_(false);
    }
  }
}

std::string CausalLM::hf_name(size_t layer, const std::string& name) const {
  if (layer == 0) return "model." + name;
  if (layer <= static_cast<size_t>(config_.num_hidden_layers)) {
    return "model.layers." + std::to_string(layer - 1) + "." + name;
  }
  if (name == "tied_weight") return "lm_head.weight";
  if (name == "lm_head.weight") return name;
  return "model." + name;
}

std::vector<std::pair<std::string, at::Tensor>> CausalLM::hf_state_dict() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  size_t layer = 0;
  for (const auto& child : sequential_->children()) {
    for (const auto& item : child->named_parameters()) {
      if (item.key() == "tied_weight") continue;  // the embedding, saved once
      out.emplace_back(hf_name(layer, item.key()), item.value());
    }
    ++layer;
  }
  return out;
}

namespace {

// Note [Expert checkpoint layout]
// Checkpoints on disk (the hub's, and what transformers 5 saves) hold each
// expert's projections apart: "<layer>.mlp.experts.<e>.{gate,up,down}_proj.
// weight". The preset (as transformers in memory) stacks them:
// "experts.gate_up_proj" [E, 2I, H] is gate's rows then up's, per expert;
// "experts.down_proj" [E, H, I]. Loading stacks (a copy: stacked experts
// are never the file's mapped pages); saving writes the per-expert tensors.
bool is_stacked_expert_name(const std::string& name) {
  const auto ends = [&](const std::string& suffix) {
    return name.size() > suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends(".experts.gate_up_proj") || ends(".experts.down_proj");
}

// Note [MXFP4 experts]
// GPT-OSS's released checkpoints store the experts' weights in MXFP4 (its
// config's quantization_config): for "<...>.experts.gate_up_proj" the
// tensors "<...>_blocks" [E, out, in / 32, 16] uint8, two 4-bit e2m1 values
// a byte (the low nibble first), and "<...>_scales" [E, out, in / 32] uint8,
// one power of two per 32 values (its exponent + 127). They are
// dequantised as they load, on the host, one expert at a time, into the
// model's dtype and transposed to the preset's [E, in, out]: the host then
// holds 2 bytes a value in bf16 instead of MXFP4's 17/32 (3.8 x; GPT-OSS-20B's
// experts, 19.1 G values, grow from 10.1 GB to 38.2 GB). The values are
// exact in bf16 (e2m1 times a power of two), so nothing is lost but memory.
// save_pretrained writes them dequantised, without the quantization_config.
at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales,
                            at::ScalarType dtype) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte &&
                  blocks.dim() == 4 && scales.dim() == 3 &&
                  blocks.sizes().slice(0, 3) == scales.sizes(),
              "MXFP4 weights need uint8 blocks [experts, out, groups, bytes] and uint8 scales "
              "[experts, out, groups], got ",
              blocks.scalar_type(), " ", blocks.sizes(), " and ", scales.scalar_type(), " ",
              scales.sizes());
  static const float kE2M1[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const auto values = at::from_blob(const_cast<float*>(kE2M1), {16}, at::kFloat);
  const int64_t E = blocks.size(0), out = blocks.size(1), groups = blocks.size(2);
  const int64_t in = groups * blocks.size(3) * 2;
  auto result = at::empty({E, in, out}, at::TensorOptions().dtype(dtype));
  for (int64_t e = 0; e < E; ++e) {
    const auto bytes = blocks[e].to(at::kLong);  // [out, groups, 16]
    const auto pairs = at::stack(
        {values.index({bytes.bitwise_and(15)}), values.index({bytes.bitwise_right_shift(4)})},
        -1);  // [out, groups, 16, 2]: low nibble first
    const auto exponents = scales[e].to(at::kInt).sub(127).view({out, groups, 1, 1});
    result[e].copy_(at::ldexp(pairs, exponents).view({out, in}).t());
  }
  return result;
}

// The per-expert tensors of a stacked one, in checkpoint order.
safetensors::NamedTensors per_expert_tensors(const std::string& name, const at::Tensor& stacked) {
  const auto dot = name.rfind('.');
  const std::string prefix = name.substr(0, dot + 1), what = name.substr(dot + 1);
  safetensors::NamedTensors out;
  for (int64_t e = 0; e < stacked.size(0); ++e) {
    const std::string expert = prefix + std::to_string(e) + ".";
    if (what == "down_proj") {
      out.emplace_back(expert + "down_proj.weight", stacked[e]);
    } else {
      const auto halves = stacked[e].chunk(2, 0);
      out.emplace_back(expert + "gate_proj.weight", halves[0]);
      out.emplace_back(expert + "up_proj.weight", halves[1]);
    }
  }
  return out;
}

}  // namespace

CausalLM CausalLM::from_pretrained(const std::string& dir, CausalLMOptions options) {
  auto config = CausalLMConfig::from_json_file((fs::path(dir) / "config.json").string());
  const bool map = options.map_weights && !options.pin_memory;
  // Mapped: the weights are about to be replaced by the file's pages, so
  // they are allocated untouched (no resident memory) instead of initialised.
  CausalLM model(config, map ? CausalLMOptions(options).set_init_weights(false) : options);
  const auto files = weight_files(dir);
  std::map<std::string, safetensors::File> loaded;
  // The tensor `name`, undefined if the checkpoint has none.
  auto find_tensor = [&](const std::string& name) -> at::Tensor {
    std::string file = files.count("") ? files.at("") : "";
    if (file.empty()) {
      auto it = files.find(name);
      if (it == files.end()) return {};
      file = it->second;
    }
    auto& f = loaded[file];
    if (f.tensors.empty()) f = safetensors::load_file(file);
    for (const auto& [n, t] : f.tensors) {
      if (n == name) return t;
    }
    return {};
  };
  auto tensor_named = [&](const std::string& name) {
    auto t = find_tensor(name);
    TORCH_CHECK(t.defined(), dir, ": the checkpoint has no tensor '", name, "'");
    return t;
  };
  c10::NoGradGuard no_grad;
  const bool per_expert_on_disk = !config.gpt_oss_experts;
  for (auto& [name, p] : model.hf_state_dict()) {
    if (is_lora_name(name)) continue;  // an adapter, not the base model's
    at::Tensor t;
    if (!per_expert_on_disk && is_stacked_expert_name(name) && !find_tensor(name).defined()) {
      // Note [MXFP4 experts]
      const auto blocks = find_tensor(name + "_blocks"), scales = find_tensor(name + "_scales");
      TORCH_CHECK(blocks.defined() && scales.defined(), dir, ": the checkpoint has no tensor '",
                  name, "' nor its MXFP4 blocks and scales ('", name, "_blocks', '_scales')");
      t = dequantize_mxfp4(blocks, scales, p.scalar_type());
    } else if (per_expert_on_disk && is_stacked_expert_name(name)) {
      // Note [Expert checkpoint layout]
      std::vector<at::Tensor> experts;
      for (const auto& named : per_expert_tensors(name, p))
        experts.push_back(tensor_named(named.first));
      const auto down = name.compare(name.size() - 9, 9, "down_proj") == 0;
      std::vector<at::Tensor> stacked;
      for (size_t i = 0; i < experts.size(); i += down ? 1 : 2)
        stacked.push_back(down ? experts[i] : at::cat({experts[i], experts[i + 1]}, 0));
      t = at::stack(stacked);
    } else {
      t = tensor_named(name);
    }
    TORCH_CHECK(t.sizes() == p.sizes(), dir, ": '", name, "' has shape ", t.sizes(),
                " in the checkpoint but the config gives ", p.sizes());
    if (map && t.scalar_type() == p.scalar_type()) {
      p.set_data(t);  // the mapped pages themselves
    } else {
      p.copy_(t);
    }
  }
  return model;
}

void CausalLM::save_adapter(const std::string& dir, const std::string& base_model) const {
  const auto& lora = options_.lora;
  TORCH_CHECK(lora.rank > 0,
              "save_adapter: the model has no LoRA adapters (CausalLMOptions::lora)");
  std::vector<std::string> targets;
  for (const char* t :
       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    if (lora.targets_projection(t)) targets.emplace_back(t);
  nlohmann::ordered_json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path",
       base_model.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(base_model)},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", lora.dropout},
      {"use_rslora", lora.use_rslora},
      {"target_modules",
       targets.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(targets)},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"modules_to_save", nullptr},
      {"use_dora", false}};
  std::vector<std::string> expert_weights;
  for (const char* w : {"gate_up_proj", "down_proj"})
    if (lora.targets_experts(w)) expert_weights.push_back(std::string("mlp.experts.") + w);
  if (!expert_weights.empty()) config["target_parameters"] = expert_weights;
  // peft's patterns: a regular expression matched against the module path.
  for (const auto& [weight, r] : lora.expert_rank)
    config["rank_pattern"][".*\\.mlp\\.experts\\." + weight] = r;
  for (const auto& [weight, a] : lora.expert_alpha)
    config["alpha_pattern"][".*\\.mlp\\.experts\\." + weight] = a;
  safetensors::NamedTensors tensors;
  for (const auto& [name, t] : hf_state_dict())
    if (is_lora_name(name))
      tensors.emplace_back("base_model.model." + name, t.detach().contiguous());
  const std::set<std::string> ours = {"adapter_config.json", "adapter_model.safetensors"};
  write_files_into_directory(
      dir,
      [&](const std::string& tmp_dir) {
        const fs::path tmp(tmp_dir);
        std::ofstream(tmp / "adapter_config.json") << config.dump(2);
        safetensors::save_file((tmp / "adapter_model.safetensors").string(), tensors,
                               {{"format", "pt"}});
      },
      [&](const std::string& name) { return ours.count(name) > 0; });
}

void CausalLM::merge_lora() {
  const auto& lora = options_.lora;
  if (lora.rank <= 0) return;
  c10::NoGradGuard no_grad;
  for (const auto& module : sequential_->modules(/*include_self=*/false)) {
    if (auto* experts = dynamic_cast<MoeExpertsImpl*>(module.get())) {  // Note [Expert LoRA]
      auto merge = [&](const at::Tensor& stacked, const LoraFactors& adapter) {
        if (!adapter) return;
        const auto delta =
            at::bmm(adapter->b(at::kFloat), adapter->a(at::kFloat)) * adapter->scaling;
        auto weight = experts->out_in(stacked);  // (a view: the copy writes the weights)
        weight.copy_(weight.to(at::kFloat) + delta);
        adapter->lora_B->weight.zero_();
      };
      merge(experts->gate_up_proj, experts->gate_up_lora);
      merge(experts->down_proj, experts->down_lora);
      continue;
    }
    auto* linear = dynamic_cast<LinearImpl*>(module.get());
    if (linear == nullptr || linear->lora.rank == 0) continue;
    const auto& A = linear->lora_A->weight;
    const auto& B = linear->lora_B->weight;
    const auto delta = at::matmul(B.to(at::kFloat), A.to(at::kFloat)) * lora.scaling();
    linear->weight.copy_(linear->weight.to(at::kFloat) + delta);
    B.zero_();
  }
}

bool is_weight_file(const std::string& name) {
  static const std::regex shard(R"(model-[0-9]+-of-[0-9]+\.safetensors)");
  return name == "model.safetensors" || name == "model.safetensors.index.json" ||
         std::regex_match(name, shard);
}

void CausalLM::save_pretrained(const std::string& dir, int64_t max_shard_bytes) const {
  // Only our own files change: a tokenizer or README beside them stays, and
  // the shards of an earlier save that this one does not overwrite go.
  write_files_into_directory(
      dir,
      [&](const std::string& tmp_dir) {
        const fs::path tmp(tmp_dir);
        {
          std::ofstream out(tmp / "config.json");
          out << config_.to_json_string();
        }
        // Shards of at most max_shard_bytes (a larger single tensor gets its own).
        std::vector<safetensors::NamedTensors> shards(1);
        int64_t shard_bytes = 0, total = 0;
        for (auto& [name, t] : hf_state_dict()) {
          if (is_lora_name(name)) continue;  // the base model's weights only
          if (shard_bytes > 0 && shard_bytes + static_cast<int64_t>(t.nbytes()) > max_shard_bytes) {
            shards.emplace_back();
            shard_bytes = 0;
          }
          // (Stacked experts go to disk one tensor per expert and projection.)
          auto tensors = is_stacked_expert_name(name) && !config_.gpt_oss_experts
                             ? per_expert_tensors(name, t)
                             : safetensors::NamedTensors{{name, t}};
          for (auto& [saved_name, saved] : tensors) shards.back().emplace_back(saved_name, saved);
          shard_bytes += t.nbytes();
          total += t.nbytes();
        }
        const std::map<std::string, std::string> metadata = {{"format", "pt"}};
        if (shards.size() == 1) {
          safetensors::save_file((tmp / "model.safetensors").string(), shards[0], metadata);
        } else {
          nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}},
                                          {"weight_map", nlohmann::ordered_json::object()}};
          for (size_t i = 0; i < shards.size(); ++i) {
            char name[64];
            std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1,
                          shards.size());
            safetensors::save_file((tmp / name).string(), shards[i], metadata);
            for (const auto& [tensor, t] : shards[i]) index["weight_map"][tensor] = name;
          }
          std::ofstream out(tmp / "model.safetensors.index.json");
          out << index.dump(2);
        }
      },
      is_weight_file);
}

}  // namespace roundpipe::models

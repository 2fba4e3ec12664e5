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
#include "models/experts.h"
#include "models/modules.h"
#include "roundpipe/layer.h"
#include "roundpipe/models/fused_ops.h"
#include "roundpipe/safetensors.h"

namespace fs = std::filesystem;

namespace roundpipe::models {
using namespace detail;  // the building blocks (modules.h, experts.h)
namespace {

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

}  // namespace roundpipe::models

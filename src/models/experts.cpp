// The sparse MoE block's routing and its experts' arithmetic: grouped
// products over rows sorted by expert, their own autograd in token chunks,
// and the router's load-balancing statistics.
#include "models/experts.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "roundpipe/recompute.h"

namespace roundpipe::models::detail {

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

ExpertMath SparseMoeImpl::math() const {
  ExpertMath m;
  m.experts = config.num_experts;
  m.gpt_oss = config.gpt_oss_experts;
  m.swiglu_limit = config.swiglu_limit;
  m.grouped = grouped;
  if (experts->gate_up_lora) m.gate_up_scaling = experts->gate_up_lora->scaling;
  if (experts->down_lora) m.down_scaling = experts->down_lora->scaling;
  return m;
}

at::Tensor SparseMoeImpl::forward(const at::Tensor& x, const std::optional<SequenceLayout>& layout,
                                  at::Tensor* stats) {
  const int64_t k = config.num_experts_per_tok;
  const auto flat = x.reshape({-1, x.size(-1)});
  const auto logits = router ? router(flat) : at::linear(flat, gate->weight);
  const auto probs = at::softmax(logits, -1, at::kFloat);
  auto [top_p, top_e] = at::topk(probs, k, -1);
  if (stats) *stats = *stats + router_statistics(probs, top_e, layout);
  if (config.norm_topk_prob) top_p = top_p / top_p.sum(-1, /*keepdim=*/true);
  const auto weights = top_p.to(logits.scalar_type());
  const auto tensors = experts->tensors(x.scalar_type());
  // With or without grad: without, the chunks alone bound the
  // intermediates (Note [Expert token chunks]).
  // (A chunk of a microbatch's rows as the whole microbatch: row_chunk_scale().)
  if (chunk_tokens > 0 &&
      static_cast<double>(flat.size(0)) * row_chunk_scale() > static_cast<double>(chunk_tokens))
    return TokenChunkedExperts::apply(flat, top_e, weights, at::TensorList(tensors), chunk_tokens,
                                      math())
        .view(x.sizes());
  return math().forward(flat, top_e, weights, tensors).view(x.sizes());
}

}  // namespace roundpipe::models::detail

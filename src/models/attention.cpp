#include "models/attention.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <vector>

#ifdef ROUNDPIPE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace roundpipe::models {
namespace {

// Sequences are appended token by token; close() ends the current one.
struct LayoutBuilder {
  std::vector<int64_t> tokens;
  std::vector<int32_t> starts{0};
  int64_t longest = 0;

  void add(int64_t token) { tokens.push_back(token); }
  void close() {
    const int64_t length = static_cast<int64_t>(tokens.size()) - starts.back();
    if (length == 0) return;
    TORCH_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX),
                "a batch of more than 2^31 tokens does not fit flash attention's int32 offsets; "
                "split it into more calls");
    starts.push_back(static_cast<int32_t>(tokens.size()));
    longest = std::max(longest, length);
  }
  SequenceLayout finish() const {
    SequenceLayout layout;
    layout.token_index = at::from_blob(const_cast<int64_t*>(tokens.data()),
                                       {static_cast<int64_t>(tokens.size())}, at::kLong)
                             .clone();
    layout.cu_seqlens = at::from_blob(const_cast<int32_t*>(starts.data()),
                                      {static_cast<int64_t>(starts.size())}, at::kInt)
                            .clone();
    layout.max_seqlen = longest;
    return layout;
  }
};

// Each row's tokens where the mask is set: one sequence per row.
std::optional<SequenceLayout> layout_of_mask(const at::Tensor& attention_mask, int64_t batch,
                                             int64_t seq) {
  const auto keep = attention_mask.to(at::kCPU).ne(0).contiguous();
  // An all-ones mask masks nothing: plain causal attention, no layout.
  if (keep.all().item<bool>()) return std::nullopt;
  const auto k = keep.accessor<bool, 2>();
  LayoutBuilder builder;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      if (k[b][t]) builder.add(b * seq + t);
    }
    builder.close();
  }
  return builder.finish();
}

// Packed documents: a row splits where a position does not follow the
// previous one (transformers' find_packed_sequence_indices).
std::optional<SequenceLayout> layout_of_positions(const at::Tensor& position_ids, int64_t batch,
                                                  int64_t seq) {
  const auto positions = position_ids.to(at::kCPU, at::kLong).expand({batch, seq}).contiguous();
  const auto p = positions.accessor<int64_t, 2>();
  LayoutBuilder builder;
  bool packed = false;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      if (t > 0 && p[b][t] != p[b][t - 1] + 1) {
        builder.close();
        packed = true;
      }
      builder.add(b * seq + t);
    }
    builder.close();
  }
  if (!packed) return std::nullopt;
  return builder.finish();
}

// [len, heads, hd] rows of one sequence as SDPA's [1, heads, len, hd].
at::Tensor as_batch_of_one(const at::Tensor& x, int64_t start, int64_t length) {
  return x.narrow(0, start, length).transpose(0, 1).unsqueeze(0);
}

// Note [Attention sinks]
// GPT-OSS gives each head a learned logit s_h that joins every query's
// softmax as one more key with no value: the weights are exp(score_j) /
// (sum_j exp(score_j) + exp(s_h)), so a query may attend to nothing. That
// is plain attention o (whose softmax sums over the keys alone, to
// exp(lse)) times w = exp(lse) / (exp(lse) + exp(s_h)) = sigmoid(lse - s_h):
// the flash kernels, which return lse, compute it in memory linear in the
// sequence (SinkAttention). Its backward adds what o's backward lacks, the
// path through lse: with g = sum_d(dy o) w (1 - w) per query and head,
// dlse/dq_i = scale sum_j p_ij k_j (the kernel's forward with k as the
// values), dlse/dk_j = scale sum_i p_ij g_i q_i (the kernel backward's dV
// for the output gradient scale g q), and ds_h = -sum g: one more forward
// and backward of the kernel. attention_with_sinks forms the scores
// explicitly instead ([heads, len, len]), as transformers' eager
// attention does: the tests' oracle.
at::Tensor attention_with_sinks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, int64_t window, const at::Tensor& sinks) {
  const int64_t B = q.size(0), H = q.size(1), len = q.size(2), groups = H / k.size(1);
  const auto keys = k.repeat_interleave(groups, 1), values = v.repeat_interleave(groups, 1);
  auto scores = at::matmul(q, keys.transpose(-2, -1)) * scale;  // [B, H, len, len]
  const auto i = at::arange(len, q.options().dtype(at::kLong));
  const auto behind = i.unsqueeze(1) - i.unsqueeze(0);  // query - key
  auto seen = behind.ge(0);
  if (window > 0) seen = seen.logical_and(behind.lt(window));
  scores = scores.masked_fill(seen.logical_not(), -std::numeric_limits<double>::infinity());
  const auto sink = sinks.to(scores.scalar_type()).view({1, H, 1, 1}).expand({B, H, len, 1});
  auto logits = at::cat({scores, sink}, -1);
  logits = logits - std::get<0>(logits.max(-1, /*keepdim=*/true)).detach();
  const auto weights = at::softmax(logits, -1).narrow(-1, 0, len);
  return at::matmul(weights.to(values.scalar_type()), values);
}

// The keys each query sees ([len, len], true: seen), causal within `window`.
at::Tensor seen_keys(int64_t len, int64_t window, const at::TensorOptions& options) {
  const auto i = at::arange(len, options.dtype(at::kLong));
  const auto behind = i.unsqueeze(1) - i.unsqueeze(0);  // query - key
  return window > 0 ? behind.ge(0).logical_and(behind.lt(window)) : behind.ge(0);
}

// A flash kernel pair for SinkAttention: LibTorch's CPU flash attention on
// [B, heads, len, hd] (the same head count for q, k, v), lse [B, heads, len].
struct CpuFlash {
  double scale;
  at::Tensor mask;  // undefined: plain causal
  std::optional<at::Tensor> optional_mask() const {
    return mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v) const {
    return at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, !mask.defined(),
                                                           optional_mask(), scale);
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dout,
                                                          const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const at::Tensor& out,
                                                          const at::Tensor& lse) const {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0,
                                                                    !mask.defined(), mask, scale);
  }
  // lse and the sinks shaped to broadcast over the output.
  at::Tensor lse_by_output(const at::Tensor& lse) const { return lse.unsqueeze(-1); }
  at::Tensor sinks_by_output(const at::Tensor& sinks) const { return sinks.view({1, -1, 1, 1}); }
  void save(torch::autograd::AutogradContext* ctx) const {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["mask"] = mask;
  }
  static CpuFlash load(torch::autograd::AutogradContext* ctx) {
    return {ctx->saved_data["scale"].toDouble(), ctx->saved_data["mask"].toTensor()};
  }
};

// Note [Attention sinks]: softmax(q k^T scale) v with a sink logit per head,
// by a flash kernel pair (CpuFlash, CudaFlash) in memory linear in the
// sequence.
template <typename Kernels>
struct SinkAttention : torch::autograd::Function<SinkAttention<Kernels>> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& sinks,
                            Kernels kernels) {
    auto [out, lse] = kernels.forward(q, k, v);
    const auto w = at::sigmoid(kernels.lse_by_output(lse) -
                               kernels.sinks_by_output(sinks).to(lse.scalar_type()));
    ctx->save_for_backward({q, k, v, sinks, out, lse});
    kernels.save(ctx);
    return out * w.to(out.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto kernels = Kernels::load(ctx);
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &sinks = saved[3];
    const auto &out = saved[4], &lse = saved[5];
    const auto dy = grads[0].contiguous();
    const auto w = at::sigmoid(kernels.lse_by_output(lse) -
                               kernels.sinks_by_output(sinks).to(lse.scalar_type()));
    // The path through o, then the one through lse (g per query and head).
    auto [dq, dk, dv] =
        kernels.backward((dy * w.to(dy.scalar_type())).contiguous(), q, k, v, out, lse);
    const auto g = (dy.to(at::kFloat) * out.to(at::kFloat)).sum(-1, /*keepdim=*/true) * w * (1 - w);
    const double scale = kernels.scale;
    const auto keys_seen = std::get<0>(kernels.forward(q, k, k));  // sum_j p_ij k_j
    dq = dq + (keys_seen.to(at::kFloat) * g * scale).to(dq.scalar_type());
    const auto through_lse = (q.to(at::kFloat) * g * scale).to(q.scalar_type()).contiguous();
    dk = dk + std::get<2>(kernels.backward(through_lse, q, k, v, out, lse));
    // ds_h = -sum of g over everything but the heads.
    auto dsinks = -(g.expand_as(out.to(at::kFloat)).select(-1, 0));
    const auto by_head = kernels.sinks_by_output(sinks);
    std::vector<int64_t> dims;
    for (int64_t d = 0; d + 1 < by_head.dim(); ++d)
      if (by_head.size(d) == 1) dims.push_back(d);
    dsinks = dsinks.sum(dims).reshape(sinks.sizes()).to(sinks.scalar_type());
    return {dq, dk, dv, dsinks, at::Tensor()};
  }
};

// Causal attention of [B, heads, len, hd] tensors through SDPA; a window
// takes a [len, len] mask of the keys each query sees; sinks: Note
// [Attention sinks].
at::Tensor sdpa_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       int64_t window, const at::Tensor& sinks = {}) {
  if (sinks.defined()) {
    const int64_t groups = q.size(1) / k.size(1);
    const auto st = q.scalar_type();
    if (q.is_cpu() && (st == at::kFloat || st == at::kBFloat16 || st == at::kHalf)) {
      // (The CPU kernel takes an additive mask of the query's dtype.)
      const auto mask =
          window > 0 ? at::zeros({q.size(2), q.size(2)}, q.options())
                           .masked_fill(seen_keys(q.size(2), window, q.options()).logical_not(),
                                        -std::numeric_limits<double>::infinity())
                     : at::Tensor();
      return SinkAttention<CpuFlash>::apply(
          q.contiguous(), k.repeat_interleave(groups, 1).contiguous(),
          v.repeat_interleave(groups, 1).contiguous(), sinks, CpuFlash{scale, mask});
    }
    return attention_with_sinks(q, k, v, scale, window, sinks);
  }
  if (window <= 0) {
    return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/true, scale,
                                            /*enable_gqa=*/true);
  }
  const auto i = at::arange(q.size(2), q.options().dtype(at::kLong));
  const auto behind = i.unsqueeze(1) - i.unsqueeze(0);  // query - key
  const auto seen = behind.ge(0).logical_and(behind.lt(window));
  return at::scaled_dot_product_attention(q, k, v, seen, 0.0, /*is_causal=*/false, scale,
                                          /*enable_gqa=*/true);
}

// Sequence by sequence: exact on any device; SDPA's own causal kernels keep
// each sequence's attention memory linear in its length (not with a window:
// its mask is [len, len]).
at::Tensor attention_per_sequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const SequenceLayout& layout, double scale, int64_t window,
                                  const at::Tensor& sinks) {
  const auto starts = layout.cu_seqlens.to(at::kCPU);
  const auto s = starts.accessor<int32_t, 1>();
  std::vector<at::Tensor> outs;
  outs.reserve(starts.size(0) - 1);
  for (int64_t i = 0; i + 1 < starts.size(0); ++i) {
    const int64_t start = s[i], length = s[i + 1] - s[i];
    auto out = sdpa_causal(as_batch_of_one(q, start, length), as_batch_of_one(k, start, length),
                           as_batch_of_one(v, start, length), scale, window, sinks);
    outs.push_back(out.squeeze(0).transpose(0, 1));  // [length, heads, hd]
  }
  return at::cat(outs, 0);
}

#ifdef ROUNDPIPE_WITH_CUDA
// LibTorch's flash kernel: half/bfloat16 on sm 8.0+, head dims it compiles.
bool flash_takes(const at::Tensor& q) {
  const auto t = q.scalar_type();
  if (!q.is_cuda() || (t != at::kHalf && t != at::kBFloat16)) return false;
  if (q.size(-1) % 8 != 0 || q.size(-1) > 256) return false;
  if (!at::globalContext().userEnabledFlashSDP()) return false;
  return at::cuda::getDeviceProperties(q.device().index())->major >= 8;
}

// Flash's window: the keys left of the query it sees (the query's own is
// one of the `window`); none is the whole sequence.
std::optional<int64_t> flash_window(int64_t window) {
  return window > 0 ? std::optional<int64_t>(window - 1) : std::nullopt;
}

// All sequences in one kernel call (cu_seqlens form); differentiable
// through LibTorch's own backward of _flash_attention_forward.
at::Tensor attention_flash_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const SequenceLayout& layout, double scale, int64_t window) {
  TORCH_CHECK(layout.cu_seqlens.device() == q.device(),
              "the sequence offsets must be on the attention's device (", q.device(), "), got ",
              layout.cu_seqlens.device());
  auto result = at::_flash_attention_forward(
      q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen, layout.max_seqlen, 0.0,
      /*is_causal=*/true, /*return_debug_mask=*/false, scale, flash_window(window),
      window > 0 ? std::optional<int64_t>(0) : std::nullopt);
  return std::get<0>(result);
}

// The CUDA flash kernel pair for SinkAttention (Note [Attention sinks]):
// [N, heads, hd] in cu_seqlens form (grouped key/value heads as they are),
// lse [heads, N].
struct CudaFlash {
  double scale;
  at::Tensor cu_seqlens;
  int64_t max_seqlen;
  int64_t window;
  mutable at::Tensor rng_state, unused;  // the forward's, for its backward
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v) const {
    auto r = at::_flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                          0.0, /*is_causal=*/true,
                                          /*return_debug_mask=*/false, scale, flash_window(window),
                                          window > 0 ? std::optional<int64_t>(0) : std::nullopt);
    rng_state = std::get<2>(r);
    unused = std::get<3>(r);
    TORCH_CHECK(std::get<1>(r).dim() == 2 && std::get<1>(r).size(0) == q.size(1) &&
                    std::get<1>(r).size(1) == q.size(0),
                "attention sinks: the flash kernel's logsumexp is ", std::get<1>(r).sizes(),
                ", expected [heads, tokens] = [", q.size(1), ", ", q.size(0), "]");
    return {std::get<0>(r), std::get<1>(r)};
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dout,
                                                          const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v,
                                                          const at::Tensor& out,
                                                          const at::Tensor& lse) const {
    return at::_flash_attention_backward(
        dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0,
        /*is_causal=*/true, rng_state, unused, scale, flash_window(window),
        window > 0 ? std::optional<int64_t>(0) : std::nullopt);
  }
  at::Tensor lse_by_output(const at::Tensor& lse) const { return lse.t().unsqueeze(-1); }
  at::Tensor sinks_by_output(const at::Tensor& sinks) const { return sinks.view({1, -1, 1}); }
  void save(torch::autograd::AutogradContext* ctx) const {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cu_seqlens"] = cu_seqlens;
    ctx->saved_data["max_seqlen"] = max_seqlen;
    ctx->saved_data["window"] = window;
    ctx->saved_data["rng_state"] = rng_state;
    ctx->saved_data["unused"] = unused;
  }
  static CudaFlash load(torch::autograd::AutogradContext* ctx) {
    auto& d = ctx->saved_data;
    return {d["scale"].toDouble(), d["cu_seqlens"].toTensor(), d["max_seqlen"].toInt(),
            d["window"].toInt(),   d["rng_state"].toTensor(),  d["unused"].toTensor()};
  }
};

// Rows as the sequences, [B, T, heads, hd] as they are.
at::Tensor attention_flash_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, int64_t window) {
  auto result = at::_flash_attention_forward(
      q, k, v, std::nullopt, std::nullopt, q.size(1), k.size(1), 0.0, /*is_causal=*/true,
      /*return_debug_mask=*/false, scale, flash_window(window), std::optional<int64_t>(0));
  return std::get<0>(result);
}
#endif

}  // namespace

c10::IValue SequenceLayout::to_ivalue() const {
  return c10::ivalue::Tuple::create({token_index, cu_seqlens, max_seqlen});
}

std::optional<SequenceLayout> SequenceLayout::from_ivalue(const c10::IValue& value) {
  if (value.isNone()) return std::nullopt;
  TORCH_CHECK(value.isTuple() && value.toTupleRef().elements().size() == 3,
              "a decoder layer got an attention layout that is not (token_index, cu_seqlens, "
              "max_seqlen): feed it the input adapter's output");
  const auto& e = value.toTupleRef().elements();
  SequenceLayout layout;
  layout.token_index = e[0].toTensor();
  layout.cu_seqlens = e[1].toTensor();
  layout.max_seqlen = e[2].toInt();
  return layout;
}

std::optional<SequenceLayout> sequence_layout(const at::Tensor& attention_mask,
                                              const at::Tensor& position_ids, int64_t batch,
                                              int64_t seq) {
  if (attention_mask.defined()) {
    TORCH_CHECK(attention_mask.dim() == 2 && attention_mask.size(0) == batch &&
                    attention_mask.size(1) == seq,
                "attention_mask must be [batch, sequence] like input_ids ([", batch, ", ", seq,
                "]), got ", attention_mask.sizes(), " (a 4D mask is not taken: pass the 2D one)");
    return layout_of_mask(attention_mask, batch, seq);
  }
  if (position_ids.defined()) return layout_of_positions(position_ids, batch, seq);
  return std::nullopt;
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<SequenceLayout>& layout, double scale,
                            int64_t window, const at::Tensor& sinks) {
  if (!layout) {
#ifdef ROUNDPIPE_WITH_CUDA
    // (SDPA takes no window: a window goes to the flash kernel directly.)
    if (window > 0 && !sinks.defined() && flash_takes(q))
      return attention_flash_rows(q, k, v, scale, window);
    if (sinks.defined() && flash_takes(q)) {  // the rows as sequences of one layout
      const int64_t B = q.size(0), T = q.size(1);
      auto flat = [&](const at::Tensor& x) { return x.reshape({B * T, x.size(2), x.size(3)}); };
      const auto cu = at::arange(0, (B + 1) * T, T, q.options().dtype(at::kInt));
      return SinkAttention<CudaFlash>::apply(flat(q), flat(k), flat(v), sinks,
                                             CudaFlash{scale, cu, T, window, {}, {}})
          .view(q.sizes());
    }
#endif
    auto out =
        sdpa_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, window, sinks);
    return out.transpose(1, 2);
  }
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3);
  // Padding (tokens in no sequence) keeps a zero output.
  auto out = at::zeros({B * T, H, hd}, q.options());
  if (layout->token_index.numel() == 0) return out.view({B, T, H, hd});
  auto gather = [&](const at::Tensor& x) {
    return x.reshape({B * T, x.size(2), hd}).index_select(0, layout->token_index);
  };
  const auto qs = gather(q), ks = gather(k), vs = gather(v);
  at::Tensor attended;
#ifdef ROUNDPIPE_WITH_CUDA
  if (!sinks.defined() && flash_takes(qs))
    attended = attention_flash_varlen(qs, ks, vs, *layout, scale, window);
  if (sinks.defined() && flash_takes(qs))
    attended = SinkAttention<CudaFlash>::apply(
        qs, ks, vs, sinks,
        CudaFlash{scale, layout->cu_seqlens, layout->max_seqlen, window, {}, {}});
#endif
  if (!attended.defined())
    attended = attention_per_sequence(qs, ks, vs, *layout, scale, window, sinks);
  return out.index_copy(0, layout->token_index, attended).view({B, T, H, hd});
}

}  // namespace roundpipe::models

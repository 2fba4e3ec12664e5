#include "models/attention.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

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
// (sum_j exp(score_j) + exp(s_h)), so a query may attend to nothing. Here
// the scores are formed explicitly ([heads, len, len] per sequence: memory
// quadratic in the sequence, unlike the flash paths, which take no sink),
// the sink appended as a last column and dropped after the softmax, as
// transformers' eager attention does.
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

// Causal attention of [B, heads, len, hd] tensors through SDPA; a window
// takes a [len, len] mask of the keys each query sees; sinks: Note
// [Attention sinks].
at::Tensor sdpa_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       int64_t window, const at::Tensor& sinks = {}) {
  if (sinks.defined()) return attention_with_sinks(q, k, v, scale, window, sinks);
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
#endif
  if (!attended.defined())
    attended = attention_per_sequence(qs, ks, vs, *layout, scale, window, sinks);
  return out.index_copy(0, layout->token_index, attended).view({B, T, H, hd});
}

}  // namespace roundpipe::models

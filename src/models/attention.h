// Causal self-attention of the presets over padded and packed batches
// without a [T, T] mask: the tokens that take part are gathered into
// variable-length sequences (flash attention's cu_seqlens form), so
// attention memory grows linearly with the sequence length.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <optional>

namespace roundpipe::models {

// The sequences attention runs over, when they are not simply the rows.
struct SequenceLayout {
  // [N] int64: the flat index (row * T + column) of every token that is in
  // a sequence, sequence after sequence, each in order.
  at::Tensor token_index;
  // [S + 1] int32: sequence s is token_index[cu_seqlens[s] : cu_seqlens[s + 1]].
  at::Tensor cu_seqlens;
  int64_t max_seqlen = 0;

  c10::IValue to_ivalue() const;
  // None -> nullopt (every row one causal sequence).
  static std::optional<SequenceLayout> from_ivalue(const c10::IValue& value);
};

// The layout of a [batch, seq] input, with transformers' rules (sdpa):
// - attention_mask given: each row's tokens where it is non-zero form one
//   sequence (left, right or any padding); an all-ones mask is plain causal
//   attention, and position_ids then never split a row (transformers only
//   looks for packed sequences when no mask is given);
// - else position_ids given: a row splits wherever a position is not the
//   previous one plus 1 (packed documents, positions restarting at 0, as
//   DataCollatorWithFlattening makes them);
// - nullopt when every row is one causal sequence.
// Tokens outside every sequence (padding) attend to nothing: their
// attention output is zero (transformers' flash_attention_2 does the same;
// its sdpa path lets a right-padding query attend to the tokens before it,
// which only shows in the logits at padding positions).
// Both tensors are read on the host (one small copy from a device).
std::optional<SequenceLayout> sequence_layout(const at::Tensor& attention_mask,
                                              const at::Tensor& position_ids, int64_t batch,
                                              int64_t seq);

// softmax(q k^T * scale) v, causal within each sequence of `layout` (or
// within each row without one), with grouped key/value heads; `window` > 0:
// a query sees only the last `window` keys of its sequence, itself included
// (sliding-window attention). q [B, T, H, hd], k and v [B, T, Hkv, hd];
// returns [B, T, H, hd]. On CUDA in half or bfloat16 the sequences go to
// LibTorch's flash attention kernel in one call (variable-length with a
// layout); elsewhere (CPU, the simulated devices; float32)
// scaled_dot_product_attention runs sequence by sequence (with a window,
// through a [len, len] mask). `sinks` [heads] (GPT-OSS): a learned logit per
// head in every softmax (Note [Attention sinks], attention.cpp).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<SequenceLayout>& layout, double scale,
                            int64_t window = 0, const at::Tensor& sinks = {});

}  // namespace roundpipe::models

// The model's input tuple: see model_input.h.
#include "models/model_input.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "models/attention.h"

namespace roundpipe::models {

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

int64_t count_loss_tokens(const at::Tensor& labels) {
  TORCH_CHECK(labels.dim() == 2, "labels must be [batch, sequence], got ", labels.sizes());
  return labels.narrow(1, 1, labels.size(1) - 1).ne(-100).sum().item<int64_t>();
}

namespace detail {

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

}  // namespace detail
}  // namespace roundpipe::models

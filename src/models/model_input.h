// The model's input tuple as the presets' layers hand it on: what the input
// adapter reads (CausalLMInput's tuple), the positions it derives, and the
// decoder layers' input in chunks of rows. Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <vector>

#include "roundpipe/models/causal_lm.h"

namespace roundpipe::models::detail {

// The model's input, read from the tuple (input_ids, attention_mask,
// labels, return_logits, position_ids, num_items_in_batch, inputs_embeds),
// every element after input_ids optional (None or left out; input_ids None
// where inputs_embeds is given), or from input_ids alone.
CausalLMInput parse_input(const c10::IValue& input);

// The token positions as [rows, T] float (rows 1 or batch): position_ids,
// else 0..T-1 for every row (transformers' default, left padding included).
at::Tensor token_positions(const CausalLMInput& in, int64_t B, int64_t T,
                           const c10::TensorOptions& float_options);

// The decoder layers' and output adapter's input (the input adapter's
// output tuple) in chunks of rows (Note [Tail row chunks], layer.h). Only
// with labels (the output is then the loss, a sum over tokens divided by
// num_items_in_batch, plus the logits if asked): each chunk gets the
// microbatch's count as its divisor where none was given, so that the
// chunks' losses add up to the microbatch's mean. A layout's sequences lie
// within rows, rows in order: a chunk takes those of its rows, rebased.
std::vector<c10::IValue> split_decoder_input_rows(const c10::IValue& input,
                                                  const std::vector<int64_t>& rows);

}  // namespace roundpipe::models::detail

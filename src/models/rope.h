// Rotary position embeddings as transformers computes them: the inverse
// frequencies (default, llama3 and yarn scaling) and the cos/sin tables of a
// microbatch's positions. Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

#include "roundpipe/models/config.h"

namespace roundpipe::models::detail {

// Inverse rotary frequencies [head_dim / 2], float32.
at::Tensor inverse_frequencies(const CausalLMConfig& c);

// cos and sin [rows, T, head_dim] in `dtype` for `positions` [rows, T]
// (float, on inv_freq's device), yarn's attention factor applied.
std::pair<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& positions,
                                                const at::Tensor& inv_freq,
                                                const RopeScaling& scaling, c10::ScalarType dtype);

}  // namespace roundpipe::models::detail

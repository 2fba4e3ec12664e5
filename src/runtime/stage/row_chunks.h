// A fused tail's microbatch in chunks of rows (Note [Tail row chunks],
// layer.h): how a label is cut and how the chunks' outputs and input
// gradients are put back together. Pure functions of host or device
// tensors, tested without devices (tests/runtime/stage/row_chunks_test.cpp); the
// stage runner runs the chunks (StageRun::run_tail_in_chunks, row_chunks.cpp).
// Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <vector>

namespace roundpipe::detail {

// Rows [first, first + n) of a label's tensors of `rows` rows; its other
// values (fewer dimensions, other row counts) as they are.
c10::IValue rows_of(const c10::IValue& value, int64_t rows, int64_t first, int64_t n);

// The chunks' outputs as the whole microbatch's: tensors of one or more
// dimensions concatenated on dim 0, 0-dim tensors added, anything else the
// first chunk's.
c10::IValue merge_row_chunks(const std::vector<c10::IValue>& outputs);

// The whole input's gradients from each chunk's (`chunk_grads[k][i]`: chunk
// k's gradient of flattened input tensor i; `whole`: the input's tensors):
// concatenated where the chunks split a tensor, summed where they share it
// (a tensor of the input's full shape). Undefined where no chunk has one; an
// error where only some do.
std::vector<at::Tensor> merge_chunk_input_grads(
    const std::vector<std::vector<at::Tensor>>& chunk_grads, const std::vector<at::Tensor>& whole,
    int microbatch);

}  // namespace roundpipe::detail

// Microbatch split and merge over IValue trees (REFERENCE.md section 3).
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

namespace roundpipe {

// The batch size of a value: dim 0 of its first tensor (depth-first) with at
// least one dimension. Throws when it holds no such tensor.
int64_t batch_size_of(const c10::IValue& value);

// How many microbatches a value splits into when `n` are asked for: `n`, or
// its batch size where that is smaller (as torch's pipelining splitter and
// the original do: a batch of one long sequence is one microbatch).
int microbatch_count(const c10::IValue& value, int n);

// Chunk sizes for `batch` rows over `n` microbatches: earlier chunks larger.
std::vector<int64_t> chunk_sizes(int64_t batch, int n);

// Tensors with ndim > 0 whose dim 0 equals the batch size are chunked along
// dim 0 (uneven splits: earlier chunks larger); everything else is
// replicated. Throws when the batch is smaller than `n`.
std::vector<c10::IValue> split_microbatches(const c10::IValue& value, int n);

// Tensors with ndim > 0 are concatenated on dim 0, 0-dim tensors are
// averaged, containers merge element by element, and any other value must be
// equal in every microbatch.
c10::IValue merge_microbatches(const std::vector<c10::IValue>& values);

}  // namespace roundpipe

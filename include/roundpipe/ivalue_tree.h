// Walking the tensors inside IValue trees (tuples, lists, dicts, scalars).
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <vector>

namespace roundpipe {

// The tensors of `value`, depth-first (dict entries in insertion order).
std::vector<at::Tensor> flatten_tensors(const c10::IValue& value);

// A copy of `value` with its tensors (in flatten_tensors order) replaced by
// `tensors`, which must have the same count.
c10::IValue replace_tensors(const c10::IValue& value, const std::vector<at::Tensor>& tensors);

// A copy of `value` with each tensor replaced by fn(tensor).
c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(const at::Tensor&)>& fn);

}  // namespace roundpipe

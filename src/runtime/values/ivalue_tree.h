// Walking the tensors inside IValue trees (tuples, lists, dicts, scalars).
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <vector>

namespace roundpipe {

// A value a frontend passes through the pipeline without the engine looking
// inside (the Python binding's objects and pytree node kinds), carried as an
// IValue capsule: split replicates it, to_device leaves it, and merge checks
// that every microbatch holds an equal one.
class OpaqueValue : public torch::CustomClassHolder {
 public:
  virtual bool equals(const OpaqueValue& other) const = 0;
  virtual std::string describe() const = 0;
};

// The OpaqueValue in `value`, or null when it holds something else.
const OpaqueValue* as_opaque(const c10::IValue& value);

// The tensors of `value`, depth-first (dict entries in insertion order).
std::vector<at::Tensor> flatten_tensors(const c10::IValue& value);

// A copy of `value` with its tensors (in flatten_tensors order) replaced by
// `tensors`, which must have the same count.
c10::IValue replace_tensors(const c10::IValue& value, const std::vector<at::Tensor>& tensors);

// A copy of `value` with each tensor replaced by fn(tensor).
c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(const at::Tensor&)>& fn);

// Back-propagates `grads` (one per flattened tensor of `output`) through
// the tensors of `output` that require grad and got one.
void backward_through(const c10::IValue& output, const std::vector<at::Tensor>& grads);

}  // namespace roundpipe

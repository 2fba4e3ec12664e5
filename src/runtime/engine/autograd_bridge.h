// The autograd function that connects a training forward's outputs to
// `loss.backward()`: backward on them splits the output gradients into
// microbatches the way the outputs were merged, runs the call's backward
// stages, and returns the input gradients (split inputs concatenated,
// replicated inputs summed). Its outputs are CPU tensors, so the autograd
// engine runs it on a CPU thread and never blocks a GPU's autograd thread.
// Internal header.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/parts/call.h"

namespace roundpipe::detail {

// Runs a call's backward stages and waits for them; throws its error.
using RunBackward = std::function<void(const std::shared_ptr<CallState>&)>;

// `merged` (the merge of the microbatch outputs `outs` of training call
// `call` on `input`), its tensors replaced by ones that lead back through
// the call to `input` and the parameters.
// The gradients of the call's `num_inputs` flattened input tensors, from
// its microbatches' (split inputs concatenated, replicated inputs summed;
// undefined where an input got none).
std::vector<at::Tensor> merged_input_grads(const CallState& call, int64_t num_inputs);

c10::IValue connect_to_autograd(const std::shared_ptr<CallState>& call, const c10::IValue& input,
                                const std::vector<c10::IValue>& outs, const c10::IValue& merged,
                                RunBackward run_backward, const std::string& name, int num_layers);

}  // namespace roundpipe::detail

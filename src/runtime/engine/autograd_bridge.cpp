// Connects a training forward to autograd: see autograd_bridge.h.
#include "runtime/engine/autograd_bridge.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include "runtime/values/ivalue_tree.h"

namespace roundpipe::detail {

namespace {

struct CallHandle : torch::CustomClassHolder {
  std::shared_ptr<CallState> call;
  RunBackward run_backward;
  std::string name;  // the engine's, for messages
  int num_layers = 0;
};

struct PipelineFunction : public torch::autograd::Function<PipelineFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CallHandle> handle,
                                                at::Tensor anchor, at::TensorList inputs,
                                                std::vector<at::Tensor> outputs) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["call"] = c10::IValue::make_capsule(handle);
    ctx->saved_data["num_inputs"] = static_cast<int64_t>(inputs.size());
    torch::autograd::variable_list out;
    torch::autograd::variable_list non_differentiable;
    for (auto& t : outputs) {
      out.push_back(t);
      if (t.defined() && !at::isFloatingType(t.scalar_type())) non_differentiable.push_back(t);
    }
    ctx->mark_non_differentiable(non_differentiable);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto capsule = ctx->saved_data["call"].toCapsule();
    auto* handle = static_cast<CallHandle*>(capsule.get());
    auto& call = *handle->call;
    // As with reentrant checkpointing: the backward stages add every
    // trainable parameter's gradient into .grad, which a backward asked for
    // some inputs' gradients only would not expect.
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(), handle->name,
                ": torch.autograd.grad() and backward(inputs=...) cannot run through a RoundPipe "
                "(as with reentrant checkpointing): its backward stages accumulate the gradient of "
                "every trainable parameter. Call .backward() on the loss.");
    TORCH_CHECK(!call.backward_done, handle->name,
                ": backward ran twice through the same outputs; RoundPipe frees a call's saved "
                "activations after its backward. Run forward again.");
    const int n = call.n;
    const int L = handle->num_layers;
    // Split the output gradients the way the outputs were merged.
    for (int m = 0; m < n; ++m) {
      std::vector<at::Tensor> grads;
      if (!call.packed_offsets.empty()) {  // packed: microbatch m's own tensors
        for (size_t i = call.packed_offsets[m]; i < call.packed_offsets[m + 1]; ++i) {
          const auto& g = grad_outputs[i];
          grads.push_back(g.defined() ? g.contiguous().cpu() : at::Tensor());
        }
        CallState::put(*call.grad.at(L)[m], {}, grads, nullptr, {});
        continue;
      }
      for (size_t i = 0; i < grad_outputs.size(); ++i) {
        const auto& g = grad_outputs[i];
        if (!g.defined()) {
          grads.emplace_back();
          continue;
        }
        const auto& rows = call.output_rows[i];
        if (rows[m] < 0) {
          grads.push_back((g / n).contiguous());  // a 0-dim output was averaged
        } else {
          int64_t start = 0;
          for (int k = 0; k < m; ++k) start += rows[k];
          grads.push_back(g.narrow(0, start, rows[m]).contiguous().cpu());
        }
      }
      CallState::put(*call.grad.at(L)[m], {}, grads, nullptr, {});
    }
    handle->run_backward(handle->call);
    call.backward_done = true;
    torch::autograd::variable_list result;
    result.emplace_back();  // the handle
    result.emplace_back();  // the anchor
    for (auto& g : merged_input_grads(call, ctx->saved_data["num_inputs"].toInt()))
      result.push_back(std::move(g));
    result.emplace_back();  // the outputs argument
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> merged_input_grads(const CallState& call, int64_t num_inputs) {
  // Split inputs concatenate, replicated inputs sum.
  std::vector<at::Tensor> result;
  for (int64_t i = 0; i < num_inputs; ++i) {
    if (!call.packed_input_offsets.empty()) {  // each input tensor belongs to one microbatch
      const auto& offsets = call.packed_input_offsets;
      int m = 0;
      while (static_cast<size_t>(i) >= offsets[m + 1]) ++m;
      const auto& grads = call.input_grads[m];
      const size_t j = i - offsets[m];
      result.push_back(j < grads.size() ? grads[j] : at::Tensor());
      continue;
    }
    std::vector<at::Tensor> parts;
    for (int m = 0; m < call.n; ++m) {
      const auto& grads = call.input_grads[m];
      if (i < static_cast<int64_t>(grads.size()) && grads[i].defined()) parts.push_back(grads[i]);
    }
    if (parts.size() != static_cast<size_t>(call.n)) {
      result.emplace_back();
    } else if (call.input_is_split[i]) {
      result.push_back(at::cat(parts, 0));
    } else {
      at::Tensor sum = parts[0];
      for (int m = 1; m < call.n; ++m) sum = sum + parts[m];
      result.push_back(sum);
    }
  }
  return result;
}

c10::IValue connect_to_autograd(const std::shared_ptr<CallState>& call, const c10::IValue& input,
                                const std::vector<c10::IValue>& outs, const c10::IValue& merged,
                                RunBackward run_backward, const std::string& name, int num_layers) {
  // Remember how each output tensor was merged, for splitting its gradient.
  auto flat_merged = flatten_tensors(merged);
  if (call->config.pack_output.value_or(false)) {
    call->packed_offsets = {0};
    for (const auto& out : outs) {
      call->packed_offsets.push_back(call->packed_offsets.back() + flatten_tensors(out).size());
    }
  } else {
    call->output_rows.assign(flat_merged.size(), {});
    for (const auto& out : outs) {
      auto flat = flatten_tensors(out);
      for (size_t i = 0; i < flat.size(); ++i) {
        call->output_rows[i].push_back(flat[i].defined() && flat[i].dim() > 0 ? flat[i].size(0)
                                                                              : -1);
      }
    }
  }
  auto handle = c10::make_intrusive<CallHandle>();
  handle->call = call;
  handle->run_backward = std::move(run_backward);
  handle->name = name;
  handle->num_layers = num_layers;
  auto inputs = flatten_tensors(input);
  // The anchor requires grad so the outputs join the graph even when no
  // input does (parameter gradients go to RoundPipe's own accumulators).
  auto anchor = at::empty({0}).requires_grad_(true);
  auto connected = PipelineFunction::apply(handle, anchor, at::TensorList(inputs), flat_merged);
  return replace_tensors(merged, connected);
}

}  // namespace roundpipe::detail

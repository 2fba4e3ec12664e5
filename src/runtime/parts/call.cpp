// A call's set-up: its microbatches and hand-off slots (call.h).
#include "runtime/parts/call.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "roundpipe/microbatch.h"
#include "runtime/values/ivalue_tree.h"

namespace roundpipe::detail {

std::vector<c10::IValue> CallState::split_input(const c10::IValue& input, const std::string& name) {
  const auto inputs = flatten_tensors(input);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    TORCH_CHECK(!t.defined() || t.device().is_cpu(), name, ": input tensor #", i, " is on ",
                t.device(),
                "; RoundPipe inputs must be CPU tensors (they are split into microbatches and "
                "uploaded stage by stage). Pass it with .cpu().");
    input_requires_grad.push_back(training && t.defined() && t.requires_grad());
  }
  std::vector<c10::IValue> pieces;
  if (config.packed_input.value_or(false)) {
    TORCH_CHECK(input.isTuple() && static_cast<int>(input.toTupleRef().elements().size()) == n,
                name, ": a packed input must be a tuple of num_microbatch = ", n,
                " microbatch values (the packed output of an earlier call)");
    pieces = input.toTupleRef().elements().vec();
    packed_input_offsets = {0};
    for (const auto& piece : pieces) {
      packed_input_offsets.push_back(packed_input_offsets.back() + flatten_tensors(piece).size());
    }
  } else if (config.split_input) {
    pieces = (*config.split_input)(input, n);
    TORCH_CHECK(static_cast<int>(pieces.size()) == n, name, ": split_input returned ",
                pieces.size(), " microbatches, expected num_microbatch = ", n);
    for (bool r : input_requires_grad) {
      TORCH_CHECK(!r, name,
                  ": inputs that require grad need the default split_input (their "
                  "gradients are merged back by its rules)");
    }
  } else {
    pieces = split_microbatches(input, n);
    const int64_t batch = batch_size_of(input);
    for (const auto& t : inputs) {
      input_is_split.push_back(t.defined() && t.dim() > 0 && t.size(0) == batch);
    }
  }
  // Microbatches join autograd only through the autograd bridge: detached
  // here, a backward stage never runs into the graph that produced the input.
  for (auto& piece : pieces) {
    piece = map_tensors(piece, [](const at::Tensor& t) { return t.defined() ? t.detach() : t; });
  }
  return pieces;
}

// Note [Thin checkpoints]
// What a training call keeps on the host between its forward and its
// backward is what the grain says: in layer grain every layer's input of
// every microbatch (a 64-layer, 5120-wide model over 16 x 4096 tokens:
// 41 GiB, more than its NF4 base and adapters' 20 GiB of state); in stage
// and layer-from-stage grain each backward stage's input only. A
// layer-from-stage backward stage then runs by_layer's steps
// (microbatch_steps.h): its layers without grad from that input, keeping
// each one's input for this microbatch only, the last layer with grad,
// then the others recomputed one at a time. The device holds one layer's
// activations, as in layer grain, and those inputs: a k-layer stage k - 1
// hidden states of one microbatch, a fraction of one layer's activations
// each (1/27 at 32B), so that long stages, few checkpoints, fit. They stay
// on the device, where the host would otherwise hold them (5 GiB for a
// 17-layer stage at 32B over 32,768-token microbatches) and the link carry
// them down and up again; the planner counts them in the stage's memory
// (`PlanRequest::rerun_inputs_on_device`) once activations are measured.
// Before that (the first call, its plan on parameter bytes), and in a
// retry by layer after running out of memory, they go to the host. The
// cost is one more forward of the stage's layers but the last (the planner
// adds it, `PlanRequest::rerun_from_stage_input`). The recompute replays
// each layer's random state as every grain does, so the results do not
// change.
void CallState::make_slots(int num_layers) {
  act[0] = new_slots();
  for (const auto& r : plan.forward) act[r.end] = new_slots();
  if (training) {
    for (size_t i = fused ? 1 : 0; i < plan.backward.size(); ++i) {
      const auto& r = plan.backward[i];
      if (grain == RecomputeGrain::kLayer) {
        for (int l = r.begin; l < r.end; ++l) {
          if (!act.count(l)) act[l] = new_slots();
        }
      } else if (!act.count(r.begin)) {
        act[r.begin] = new_slots();
      }
    }
    for (const auto& r : plan.backward) {
      if (r.begin > 0) grad[r.begin] = new_slots();
    }
    if (!fused) grad[num_layers] = new_slots();
    input_grads.resize(n);
  }
  if (fused) {
    losses = new_slots();
    outputs = new_slots();
  }
}

void CallState::put_inputs(const std::vector<c10::IValue>& microbatches) {
  for (int m = 0; m < n; ++m) {
    RngState rng;
    rng.active = preserve_rng;
    rng.seed = microbatch_seed(call_seed, m);
    put(*act[0][m], microbatches[m], {}, nullptr, rng);
  }
}

void CallState::split_labels(const c10::IValue& label, const std::string& name) {
  for (const auto& t : flatten_tensors(label)) {
    TORCH_CHECK(!t.defined() || t.device().is_cpu(), name,
                ": labels must be CPU tensors; found one on ", t.device());
  }
  if (config.split_label) {
    labels = (*config.split_label)(label, n);
    TORCH_CHECK(static_cast<int>(labels.size()) == n, name, ": split_label returned ",
                labels.size(), " microbatches, expected ", n);
  } else if (flatten_tensors(label).empty()) {
    labels.assign(n, label);
  } else {
    labels = split_microbatches(label, n);
  }
}

void CallState::snapshot_buffers(int layer, std::vector<at::Tensor> values) {
  std::lock_guard<std::mutex> lock(buffers_mu_);
  buffer_snapshots_[layer] = std::move(values);
}

std::vector<at::Tensor> CallState::buffer_snapshot(int layer) const {
  std::lock_guard<std::mutex> lock(buffers_mu_);
  auto it = buffer_snapshots_.find(layer);
  TORCH_CHECK(it != buffer_snapshots_.end(), "call ", id, " has no buffer snapshot of layer ",
              layer, ": its forward side did not run that layer");
  return it->second;
}

void CallState::restore_buffer_snapshots(
    const std::function<std::vector<at::Tensor>(int layer)>& homes) const {
  c10::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(buffers_mu_);
  for (const auto& [layer, snapshot] : buffer_snapshots_) {
    auto home = homes(layer);
    for (size_t i = 0; i < home.size(); ++i) home[i].copy_(snapshot[i]);
  }
}

}  // namespace roundpipe::detail

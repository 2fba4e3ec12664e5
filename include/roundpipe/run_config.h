// Per-call and per-model run settings.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "roundpipe/execute_plan.h"

namespace roundpipe {

enum class RecomputeGrain {
  kStage,  // save each backward stage's input; recompute the stage at once
  kLayer,  // save every layer's input; recompute one layer at a time
  // Save each backward stage's input, as kStage (host memory), and
  // recompute one layer at a time, as kLayer (device memory): the stage's
  // layers rerun without grad from its input first, each one's input kept
  // for that microbatch only, on the device where the plan counts it
  // (Note [Thin checkpoints]).
  kLayerFromStage,
};

// "stage", "layer", "layer_from_stage": the names the Python package and
// the command-line tools use.
const char* to_string(RecomputeGrain grain);
// The grain a name gives; throws a c10::Error listing the names otherwise.
RecomputeGrain recompute_grain_from_string(const std::string& name);

// Splits a value into `n` microbatch values.
using SplitFn = std::function<std::vector<c10::IValue>(const c10::IValue& value, int n)>;
// Merges per-microbatch outputs into one value.
using MergeFn = std::function<c10::IValue(const std::vector<c10::IValue>& outputs)>;

// The microbatch count of a call that gives none: one more than the
// devices, as the original's default, so that every device has a
// microbatch to work on while one more's result travels. The one place
// this default lives (the Python package reads it through
// roundpipe._C.default_num_microbatch).
inline int default_num_microbatch(int num_devices) {
  return num_devices + 1;
}

// Every field is optional: a value given to a call overrides the model's
// (RoundPipeOptions::model_run_config), which overrides the default.
struct RunConfig {
  std::optional<bool> requires_grad;         // default: autograd grad mode
  std::optional<c10::Device> output_device;  // default: CPU
  std::optional<bool> preserve_rng_state;    // default: true
  // Unset: the automatic plan chooses (layer grain until the layers' kept
  // activations are measured, then stage grain where it fits); with an
  // execute_plan of the caller's, stage.
  std::optional<RecomputeGrain> recompute_grain;
  std::optional<int> num_microbatch;    // default: number of devices + 1
  std::optional<SplitFn> split_input;   // default: split_microbatches()
  std::optional<SplitFn> split_label;   // default: split_microbatches()
  std::optional<MergeFn> merge_output;  // default: merge_microbatches()
  // true: no merge; the output is a tuple of the microbatch outputs (a
  // "packed" output, connected to autograd microbatch by microbatch), which
  // a next call can take as its microbatches through split_input.
  std::optional<bool> pack_output;  // default: false
  // true: the input is such a packed tuple: its elements are the
  // microbatches (num_microbatch must equal its size), and gradients flow
  // back to each microbatch's own tensors.
  std::optional<bool> packed_input;         // default: false
  std::optional<ExecutePlan> execute_plan;  // default: ExecutePlan::from_layer_costs
  // forward_backward: loss_fn's result on a microbatch is the sum of its
  // results on the microbatch's rows split in chunks, as for a loss_fn that
  // returns (or scales) a model's own loss that is a sum over tokens divided
  // by a fixed count (the presets' with labels). Lets the fused tail run a
  // microbatch chunk by chunk where memory is short (Note [Tail row chunks],
  // layer.h) instead of recomputing layers. The Python package sets it for
  // the default loss_fn, roundpipe-train for its loss.
  std::optional<bool> loss_sums_over_rows;  // default: false

  RunConfig& set_requires_grad(bool v) {
    requires_grad = v;
    return *this;
  }
  RunConfig& set_output_device(c10::Device v) {
    output_device = v;
    return *this;
  }
  RunConfig& set_preserve_rng_state(bool v) {
    preserve_rng_state = v;
    return *this;
  }
  RunConfig& set_recompute_grain(RecomputeGrain v) {
    recompute_grain = v;
    return *this;
  }
  RunConfig& set_num_microbatch(int v) {
    num_microbatch = v;
    return *this;
  }
  RunConfig& set_split_input(SplitFn v) {
    split_input = std::move(v);
    return *this;
  }
  RunConfig& set_split_label(SplitFn v) {
    split_label = std::move(v);
    return *this;
  }
  RunConfig& set_merge_output(MergeFn v) {
    merge_output = std::move(v);
    return *this;
  }
  RunConfig& set_pack_output(bool v) {
    pack_output = v;
    return *this;
  }
  RunConfig& set_packed_input(bool v) {
    packed_input = v;
    return *this;
  }
  RunConfig& set_execute_plan(ExecutePlan v) {
    execute_plan = std::move(v);
    return *this;
  }
  RunConfig& set_loss_sums_over_rows(bool v) {
    loss_sums_over_rows = v;
    return *this;
  }

  // Field by field: this call's value if set, else `model`'s.
  RunConfig overriding(const RunConfig& model) const;
};

}  // namespace roundpipe

// RunConfig (include/roundpipe/run_config.h): resolving a call's settings
// against the model's.
#include "roundpipe/run_config.h"

#include <c10/util/Exception.h>

namespace roundpipe {

RunConfig RunConfig::overriding(const RunConfig& model) const {
  RunConfig out = model;
  if (requires_grad) out.requires_grad = requires_grad;
  if (output_device) out.output_device = output_device;
  if (preserve_rng_state) out.preserve_rng_state = preserve_rng_state;
  if (recompute_grain) out.recompute_grain = recompute_grain;
  if (num_microbatch) out.num_microbatch = num_microbatch;
  if (split_input) out.split_input = split_input;
  if (split_label) out.split_label = split_label;
  if (merge_output) {
    out.merge_output = merge_output;
    out.pack_output.reset();  // a call's own merge replaces the model's packing
  }
  if (pack_output) out.pack_output = pack_output;
  if (packed_input) out.packed_input = packed_input;
  if (execute_plan) out.execute_plan = execute_plan;
  if (loss_sums_over_rows) out.loss_sums_over_rows = loss_sums_over_rows;
  return out;
}

const char* to_string(RecomputeGrain grain) {
  switch (grain) {
    case RecomputeGrain::kStage:
      return "stage";
    case RecomputeGrain::kLayer:
      return "layer";
    case RecomputeGrain::kLayerFromStage:
      return "layer_from_stage";
  }
  return "?";
}

RecomputeGrain recompute_grain_from_string(const std::string& name) {
  for (auto grain :
       {RecomputeGrain::kStage, RecomputeGrain::kLayer, RecomputeGrain::kLayerFromStage}) {
    if (name == to_string(grain)) return grain;
  }
  TORCH_CHECK(false, "recompute_grain must be \"stage\", \"layer\" or \"layer_from_stage\" (",
              "layer at a time from each backward stage's input: the host keeps a stage's ",
              "input only), got \"", name, "\"");
}

}  // namespace roundpipe

// RunConfig (include/roundpipe/run_config.h): resolving a call's settings
// against the model's.
#include "roundpipe/run_config.h"

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

}  // namespace roundpipe

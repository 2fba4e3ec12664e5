// Helpers for layers whose forward does random or host-syncing work that a
// recompute must not redo (MoE routing counts, nonzero(), .item()).
#pragma once

#include <ATen/core/ivalue.h>

namespace roundpipe {

// Called from a layer's forward: keeps `data` (which must not require grad)
// for this layer and microbatch, once per layer per microbatch. A no-op when
// the layer runs outside RoundPipe, in a recompute, or in an inference call
// (no backward follows: the original's "no-op without gradients").
void save_for_recompute(const c10::IValue& data);
// Whether the current layer call is a recompute in a backward stage.
bool doing_recompute();
// In a recompute: what the forward saved, with tensors on this device.
c10::IValue get_recompute_data();

}  // namespace roundpipe

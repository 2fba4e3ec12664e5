// Helpers a layer's forward calls to tell the engine what it cannot see:
// random or host-syncing work that a recompute must not redo (MoE routing
// counts, nonzero(), .item()), and kept memory that does not follow its rows.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>

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

// Called from a layer's forward with grad: of what it keeps for its
// backward, `bytes` do not depend on how many rows its input has (the CUDA
// fused loss makes its output weight's float32 gradient in the forward and
// keeps it). The plan counts them whole in each chunk of rows of the fused
// tail (Note [Tail row chunks], layer.h), not by the chunk's share of the
// rows. Adds up over calls in one forward; a no-op outside RoundPipe.
void note_kept_bytes_independent_of_rows(int64_t bytes);

// Called from a layer's forward: the rows of the microbatch whose chunk of
// rows its input is, over the input's own rows (1 outside a chunk of the
// fused tail's rows, Note [Tail row chunks], and outside RoundPipe). A
// layer that keeps more per row below some size of its input (the presets'
// MLP, token-chunked above mlp_chunk_tokens) decides by the whole
// microbatch's size, so that a chunk keeps its rows' share of what the
// plan measured on the whole.
double row_chunk_scale();

}  // namespace roundpipe

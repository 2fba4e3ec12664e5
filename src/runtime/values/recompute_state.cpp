// The recompute helpers of roundpipe/recompute.h: see recompute_state.h.
#include "runtime/values/recompute_state.h"

#include <c10/util/Exception.h>

#include "roundpipe/recompute.h"
#include "runtime/values/ivalue_tree.h"
#include "runtime/values/transfer.h"

namespace roundpipe {
namespace detail {

namespace {
thread_local LayerCallScope* current_layer_call = nullptr;
thread_local double current_row_chunk_scale = 1;
}  // namespace

LayerCallScope::LayerCallScope(RecomputeStore& store, int layer, int microbatch, bool recompute,
                               c10::Device device, bool training)
    : store(store),
      layer(layer),
      microbatch(microbatch),
      recompute(recompute),
      device(device),
      training(training),
      previous_(current_layer_call) {
  current_layer_call = this;
}

LayerCallScope::~LayerCallScope() {
  current_layer_call = previous_;
}

RowChunkScope::RowChunkScope(int64_t whole_rows, int64_t chunk_rows)
    : previous_(current_row_chunk_scale) {
  TORCH_CHECK(chunk_rows > 0 && whole_rows >= chunk_rows, "a chunk of ", chunk_rows,
              " rows of a microbatch of ", whole_rows);
  current_row_chunk_scale = static_cast<double>(whole_rows) / static_cast<double>(chunk_rows);
}

RowChunkScope::~RowChunkScope() {
  current_row_chunk_scale = previous_;
}

}  // namespace detail

void save_for_recompute(const c10::IValue& data) {
  auto* lc = detail::current_layer_call;
  // Outside RoundPipe (the same module run plainly), or in an inference
  // call, there is no recompute.
  if (lc == nullptr || lc->recompute || !lc->training) return;
  for (const auto& t : flatten_tensors(data)) {
    TORCH_CHECK(!t.defined() || !t.requires_grad(),
                "save_for_recompute(): data must not require grad (detach it)");
  }
  auto host = detail::to_device(data, c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(lc->store.mu);
  auto [it, inserted] = lc->store.data.emplace(std::make_pair(lc->layer, lc->microbatch), host);
  TORCH_CHECK(inserted, "save_for_recompute() called twice in layer ", lc->layer,
              " for microbatch ", lc->microbatch, "; call it once per layer per microbatch");
}

bool doing_recompute() {
  return detail::current_layer_call != nullptr && detail::current_layer_call->recompute;
}

c10::IValue get_recompute_data() {
  auto* lc = detail::current_layer_call;
  TORCH_CHECK(lc && lc->recompute,
              "get_recompute_data() is only valid during a recompute (check doing_recompute())");
  c10::IValue data;
  {
    std::lock_guard<std::mutex> lock(lc->store.mu);
    auto it = lc->store.data.find({lc->layer, lc->microbatch});
    TORCH_CHECK(it != lc->store.data.end(), "layer ", lc->layer,
                " did not call save_for_recompute() in its forward for microbatch ",
                lc->microbatch);
    data = it->second;
  }
  return detail::to_device(data, lc->device);
}

// Note [Tail row chunks of a token-chunked layer]
// The fused tail may run a microbatch in chunks of its rows, each counted
// at its rows' share of what the layers were measured to keep on whole
// microbatches (Note [Tail row chunks]). The presets' MLP runs token chunk
// by token chunk, keeping only its input, above mlp_chunk_tokens, and keeps
// its [tokens, intermediate] activations below: a chunk of rows of a
// token-chunked microbatch kept more per token than measured. On a
// simulated device (a 6-layer Qwen3-shaped model, the MLP chunked above
// 1,024 tokens, 8 x 512 tokens in 2 microbatches, a budget of 96 MiB) the
// tail's chunks peaked at 94.7 MB against a plan of 54.3 MB and ran out of
// memory; one row of a 4 x 1,024-token microbatch kept 13.5 MiB a layer
// against its share's 7.5. So a chunk tells its layers the whole
// microbatch's size (row_chunk_scale()), and they decide by it: the same
// calls then peaked within their plans (69.2 against 77.7 MB).
double row_chunk_scale() {
  return detail::current_row_chunk_scale;
}

void note_kept_bytes_independent_of_rows(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "note_kept_bytes_independent_of_rows(): bytes must be >= 0, got ", bytes);
  if (auto* lc = detail::current_layer_call) lc->kept_bytes_independent_of_rows += bytes;
}

}  // namespace roundpipe

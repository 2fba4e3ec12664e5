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

void note_kept_bytes_independent_of_rows(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "note_kept_bytes_independent_of_rows(): bytes must be >= 0, got ", bytes);
  if (auto* lc = detail::current_layer_call) lc->kept_bytes_independent_of_rows += bytes;
}

}  // namespace roundpipe

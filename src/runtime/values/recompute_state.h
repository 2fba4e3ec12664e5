// What save_for_recompute(), doing_recompute() and get_recompute_data()
// (roundpipe/recompute.h) see: the layer call they run in, set by the stage
// runner around each layer's forward, and the call's store of saved data.
// Internal header.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace roundpipe::detail {

// One call's data saved for recompute, per (layer, microbatch), on the host.
struct RecomputeStore {
  std::mutex mu;
  std::map<std::pair<int, int>, c10::IValue> data;
  // Drops what layers [begin, end) saved for `microbatch` (a try undone).
  void forget(int begin, int end, int microbatch) {
    std::lock_guard<std::mutex> lock(mu);
    for (int l = begin; l < end; ++l) data.erase({l, microbatch});
  }
};

// Marks the calling thread as running `layer` for `microbatch` of a call
// (a recompute or not) on `device`, until the scope ends. `training`: the
// call has a backward, so a recompute may follow; in an inference call
// save_for_recompute() does nothing (the original's "a no-op when gradient
// computation is not enabled").
class LayerCallScope {
 public:
  LayerCallScope(RecomputeStore& store, int layer, int microbatch, bool recompute,
                 c10::Device device, bool training = true);
  ~LayerCallScope();
  LayerCallScope(const LayerCallScope&) = delete;
  LayerCallScope& operator=(const LayerCallScope&) = delete;

  RecomputeStore& store;
  const int layer;
  const int microbatch;
  const bool recompute;
  const c10::Device device;
  const bool training;
  // What the layer's forward said it keeps whatever its rows
  // (note_kept_bytes_independent_of_rows).
  int64_t kept_bytes_independent_of_rows = 0;

 private:
  LayerCallScope* previous_;
};

// Marks the calling thread as running a chunk of `chunk_rows` of a
// microbatch's `whole_rows` (row_chunk_scale()), until the scope ends.
class RowChunkScope {
 public:
  RowChunkScope(int64_t whole_rows, int64_t chunk_rows);
  ~RowChunkScope();
  RowChunkScope(const RowChunkScope&) = delete;
  RowChunkScope& operator=(const RowChunkScope&) = delete;

 private:
  double previous_;
};

}  // namespace roundpipe::detail

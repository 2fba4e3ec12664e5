// A small ring of pinned host buffers that pageable parameter uploads go
// through (pin_model=off, or homes that could not be pinned). Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "roundpipe/device.h"
#include "support/parallel.h"

namespace roundpipe {

// Note [Staging ring]
// A copy from pageable host memory cannot run asynchronously: the driver
// stages it through its own pinned buffer while the calling thread waits,
// and the copy engine idles between its pieces. With pin_model=off (weights
// that stay pageable, e.g. a memory-mapped checkpoint larger than what may
// be pinned) the uploader instead copies each chunk of parameters into the
// next slot of this ring, on a few CPU threads, and enqueues the device
// copy from the slot, which is then asynchronous: the CPU fills slot k + 1
// while the link carries slot k. A slot is refilled only once the device
// copy that read it has completed (its event). Slots are used in ring
// order by one uploader thread at a time.

// The engine's rings: 4 slots, filled by 8 threads (one memcpy thread moves
// a few GB/s: 4 filled at 14 GB/s on the H200 host); a slot is 1/256 of the
// model's weights within [1 MiB, 32 MiB] (a 32 MiB copy takes ~0.6 ms at
// 55 GB/s; a small model needs small slots, and its ring stays small
// beside it).
constexpr int kStagingSlots = 4;
constexpr int kStagingThreads = 8;
inline int64_t staging_slot_bytes(int64_t model_bytes) {
  return std::clamp(model_bytes / 256, int64_t{1} << 20, int64_t{32} << 20);
}

class StagingRing {
 public:
  // `slots` buffers of `slot_bytes` each (pinned when `pin`), filled by
  // `copy_threads` threads.
  StagingRing(int slots, int64_t slot_bytes, bool pin, int copy_threads);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  int64_t slot_bytes() const { return slot_bytes_; }
  int slots() const { return static_cast<int>(slots_.size()); }

  // Copies the sources of `chunk` into the next slot (first waiting for the
  // device copy that read it last) and returns the chunk with the slot's
  // views as sources. Sources that do not fit the slot stay as they are.
  // The caller enqueues the copies, then calls release() with their event.
  struct Staged {
    CopyChunk chunk;
    int slot = -1;
  };
  Staged stage(const CopyChunk& chunk);
  void release(int slot, EventPtr copied);

  // Bytes copied through the ring so far.
  int64_t staged_bytes() const { return staged_bytes_.load(); }

 private:
  struct Slot {
    at::Tensor memory;  // uint8 [slot_bytes + padding room]
    EventPtr copied;    // the last copy that read it
  };
  std::vector<Slot> slots_;
  int64_t slot_bytes_;
  int next_ = 0;
  std::mutex mu_;  // next_ and the slots' events
  ThreadPool copiers_;
  std::atomic<int64_t> staged_bytes_{0};
};

}  // namespace roundpipe

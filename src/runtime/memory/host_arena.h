// HostArena: host memory in large chunks (pinned where asked and possible),
// carved into exact-size blocks. A block is its request rounded up to the
// alignment, never to a power of two; a freed block is coalesced with its free
// neighbours and reused best-fit. The engine keeps the model's parameters, the
// fused optimizer's staging copies and every download in one arena, so pinned
// memory stays close to what is actually held and is reused across iterations.
// Internal header (src/runtime); the statistics type, HostArenaStats, is
// public in roundpipe/options.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>

#include "roundpipe/options.h"  // HostArenaStats

namespace roundpipe {

struct HostArenaOptions {
  // Size of a chunk taken when no free block fits (a larger request gets a
  // chunk of its own size).
  int64_t chunk_bytes = int64_t{256} << 20;
  // Every block starts at and is rounded up to a multiple of this (a power of two).
  int64_t alignment = 512;
  // Registers each chunk with the driver (cudaHostRegister). Without CUDA the
  // chunks stay pageable and the arena works the same.
  bool pin = false;

  HostArenaOptions& set_chunk_bytes(int64_t v) {
    chunk_bytes = v;
    return *this;
  }
  HostArenaOptions& set_alignment(int64_t v) {
    alignment = v;
    return *this;
  }
  HostArenaOptions& set_pin(bool v) {
    pin = v;
    return *this;
  }
};

class HostArena {
 public:
  explicit HostArena(HostArenaOptions options = {});
  // The chunks live on while any block does: tensors may outlive the arena.
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Adds one chunk of exactly `bytes` (rounded to the alignment); 0 adds none.
  void reserve(int64_t bytes);
  // A block of `bytes` (0: an empty pointer). The block returns to the arena
  // when the DataPtr is destroyed, from any thread.
  c10::DataPtr allocate(int64_t bytes);
  // A contiguous CPU tensor whose storage is one block (no block when it has
  // no elements).
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
  // What a request of `bytes` takes: rounded up to the alignment.
  int64_t block_bytes(int64_t bytes) const;

  // A release pass (Note [Idle arena chunks go back], host_arena.cpp):
  // returns the chunks that are entirely free and that no block was taken
  // from through `passes` passes in a row, counting this one. Returns the
  // bytes released.
  int64_t release_idle_chunks(int passes);
  HostArenaStats stats() const;
  const HostArenaOptions& options() const { return options_; }

 private:
  struct State;
  HostArenaOptions options_;
  std::shared_ptr<State> state_;
};

}  // namespace roundpipe

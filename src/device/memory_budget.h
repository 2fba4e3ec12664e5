// What a CUDA process may hold on a device: Note [Device memory budget].
#pragma once

#include <cstdint>

namespace roundpipe {

// Note [Device memory budget]
// A memory cap (torch.cuda.set_per_process_memory_fraction, or a device
// spec's `mem=`) bounds what the caching allocator reserves; on a big card
// capped to stand in for a small one, the CUDA context comes on top of it,
// while a real card of that size pays for its context out of the same
// memory: a 24 GiB card gives the allocator about 23 GiB, less with a display
// attached. So under a cap the engine works within the cap less
// kCappedHeadroomBytes = 1.5 GiB: the context with the kernels a training
// run loads (0.84 GiB measured on an H200 with CUDA 13 at the end of a run,
// less on consumer cards with lazy loading) plus 0.66 GiB for a display
// server or a second program. Within what the device has left, too: other
// processes (another data-parallel rank on the same card) and the context
// are already outside `free`, so there only kUncappedMarginBytes comes off,
// for what loads later (kernel modules, library handles: 0.35 GiB grew
// between the engine's start and the end of a run on the H200). The engine
// lowers a cap's per-process fraction to this budget, so that the caching
// allocator itself keeps its reserved memory within it (it releases cached
// blocks before going past). It sets the fraction kAllocatorSlackBytes
// lower still: with expandable segments the allocator's reserved memory was
// measured 5-10 MiB past its fraction (14.51 GiB peak at a 14.5 GiB
// fraction on an H200), within one of its 20 MiB large-block roundings, so
// the fraction sits one rounding below the budget and the peak stays in it.
constexpr int64_t kCappedHeadroomBytes = int64_t{3} << 29;   // 1.5 GiB
constexpr int64_t kUncappedMarginBytes = int64_t{1} << 29;   // 0.5 GiB
constexpr int64_t kAllocatorSlackBytes = int64_t{20} << 20;  // 20 MiB

struct DeviceMemoryReading {
  int64_t total_bytes = 0;     // the device's memory
  int64_t free_bytes = 0;      // free on the device now (cudaMemGetInfo)
  int64_t reserved_bytes = 0;  // what our caching allocator holds now
  int64_t cap_bytes = 0;       // the process's cap (0: none)
};

// What the process may hold: see the Note. Never negative.
inline int64_t usable_device_bytes(const DeviceMemoryReading& r) {
  const int64_t available = r.free_bytes + r.reserved_bytes;  // what the device can still give us
  int64_t usable = available - kUncappedMarginBytes;
  if (r.cap_bytes > 0 && r.cap_bytes - kCappedHeadroomBytes < usable)
    usable = r.cap_bytes - kCappedHeadroomBytes;
  return usable > 0 ? usable : 0;
}

// The caching allocator's limit for a budget of `usable` bytes (see the
// Note): one large-block rounding below it, never below one byte.
inline int64_t allocator_limit_bytes(int64_t usable) {
  return usable > kAllocatorSlackBytes ? usable - kAllocatorSlackBytes : 1;
}

}  // namespace roundpipe

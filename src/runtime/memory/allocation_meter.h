// Bytes a stretch of code keeps allocated, on any device: while a meter is
// installed on a thread, the device allocators (the CUDA caching allocator,
// the simulated device's charging allocator) report each allocation and
// free made there to it, as they do to the profiler's memory view. Host
// allocations are not device memory: memoryProfilingEnabled() is false, so
// LibTorch's CPU allocator neither reports to the meter nor tracks sizes for
// it (which made it warn, at the first free of a block older than the
// meter, "Memory block of unknown size was allocated before the profiling
// started"). The engine meters a layer's forward with
// grad: what it still holds at the end is what that layer keeps for its
// backward (plus its output), and the most it held on the way is its
// working memory; the same for a layer's backward. Internal header.
#pragma once

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

namespace roundpipe::detail {

class AllocationMeter final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, int64_t bytes, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device /*device*/) override {
    const int64_t now = net_ += bytes;  // negative for a free
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  bool memoryProfilingEnabled() const override { return false; }
  int64_t net_bytes() const { return net_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }  // the most net_bytes() has been

 private:
  // (Threads launched with at::launch, and the autograd engine's device
  // threads, inherit the meter.)
  std::atomic<int64_t> net_{0};
  std::atomic<int64_t> peak_{0};
};

// Installs a meter on this thread for its lifetime, unless a profiler is
// active: the profiler owns the same thread-local slot and reads it as its
// own state, so then nothing is metered (meter() is null).
class MeterScope {
 public:
  MeterScope() {
    if (at::hasCallbacks()) return;
    meter_ = std::make_shared<AllocationMeter>();
    guard_.emplace(c10::DebugInfoKind::PROFILER_STATE, meter_);
  }
  const AllocationMeter* meter() const { return meter_.get(); }

 private:
  std::shared_ptr<AllocationMeter> meter_;
  std::optional<c10::DebugInfoGuard> guard_;
};

}  // namespace roundpipe::detail

// Devices: the stateless compute pool RoundPipe dispatches stages to.
//
// A Device has four ordered queues. Work enqueued on one queue runs in
// order; queues run concurrently with each other. Events recorded on a queue
// complete when everything enqueued before them has run; another queue (or
// the host) can wait for them. Backends:
//   cuda: one CUDA stream per queue, c10 CUDA events (cross-device waits).
//   sim:  a simulated accelerator on the CPU: each copy queue is a real
//         thread, so copies really run asynchronously and the scheduler's
//         races are exercised in CI; "device memory" is a budgeted CPU arena.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace roundpipe {

enum class Queue : int { kParamUpload = 0, kActUpload = 1, kCompute = 2, kDownload = 3 };
const char* queue_name(Queue q);

class StagingRing;

// A point in one queue's order. Always recorded before it is shared.
class Event {
 public:
  virtual ~Event() = default;
  // Blocks the calling host thread until the event has completed.
  virtual void synchronize() = 0;
  virtual bool query() = 0;
};
using EventPtr = std::shared_ptr<Event>;

// Makes the host tensors download() copies into: contiguous CPU tensors of
// the given sizes and dtype (the engine passes blocks of its HostArena).
using HostAllocator = std::function<at::Tensor(at::IntArrayRef sizes, at::ScalarType dtype)>;

struct DeviceMemoryStats {
  int64_t budget_bytes = 0;  // what this process may hold there (0: unlimited; CUDA: capped by
                             // the per-process memory fraction, less what others hold)
  int64_t in_use_bytes = 0;  // tracked device tensors alive now
  int64_t peak_bytes = 0;
};

// Bytes moved so far (for benchmarks: traffic per iteration, achieved rate).
struct DeviceTransferStats {
  int64_t param_upload_bytes = 0;
  int64_t activation_upload_bytes = 0;
  int64_t download_bytes = 0;
  int64_t param_upload_copies = 0;  // chunks (see kParamUploadChunkBytes)
  int64_t largest_param_copy_bytes = 0;
};

// Parameter uploads go in copies of at most this many bytes (as the
// original's), small tensors grouped, large ones sliced, so that an
// activation upload (on the critical path) never waits on the link behind
// more than one chunk of parameters.
constexpr int64_t kParamUploadChunkBytes = int64_t{256} << 20;

// One chunk of a copy: (destination slice, source slice) pairs.
using CopyChunk = std::vector<std::pair<at::Tensor, at::Tensor>>;
// Splits the copies dst[i] <- src[i] into chunks of at most chunk_bytes, in
// order (a tensor that is not contiguous is never sliced).
std::vector<CopyChunk> copy_chunks(const std::vector<at::Tensor>& dst,
                                   const std::vector<at::Tensor>& src, int64_t chunk_bytes);

class Device {
 public:
  virtual ~Device() = default;

  virtual std::string name() const = 0;          // "sim:1", "cuda:0"
  virtual c10::Device torch_device() const = 0;  // where its tensors live
  virtual bool is_simulated() const = 0;

  // Makes the calling thread this device's compute queue: the worker that
  // runs stage jobs calls it once (cuda: current device and the compute
  // stream; sim: nothing).
  virtual void bind_compute_thread() = 0;

  // Runs `work` in the order of `queue`. cuda: now, on the calling thread,
  // with the queue's stream current (work must only enqueue async ops).
  // sim: copy queues run it on the queue's thread; kCompute runs it inline.
  virtual void enqueue(Queue queue, std::function<void()> work) = 0;
  // Records an event after all work enqueued so far on `queue`.
  virtual EventPtr record(Queue queue) = 0;
  // Makes `queue` wait (device side) for `event`. A null event is a no-op.
  virtual void wait(Queue queue, const EventPtr& event) = 0;

  // Copies host tensors to new device tensors on `queue` (kParamUpload or
  // kActUpload). The copies are ordered after `after` (may be null), not
  // after the compute queue: the new tensors' memory is free of earlier
  // compute use by construction. Returns the device tensors and the event
  // that completes when they are written. `staging` (parameter uploads):
  // sources that are not pinned go through its pinned slots (Note [Staging
  // ring] in src/device/staging_ring.h); its chunks are at most a slot.
  std::pair<std::vector<at::Tensor>, EventPtr> upload(Queue queue,
                                                      const std::vector<at::Tensor>& host,
                                                      const EventPtr& after,
                                                      StagingRing* staging = nullptr) {
    return upload_impl(queue, host, after, staging);
  }
  // Copies device tensors produced by the compute queue so far into new host
  // tensors on kDownload: made by `allocate` when given, else by the backend
  // (pinned where it supports that).
  // Host tensors that upload() reads and download() writes stay referenced by
  // the device until their copy has completed, so memory that is reused as
  // soon as its last tensor goes (a HostArena block) is never reused under a
  // copy still in flight.
  virtual std::pair<std::vector<at::Tensor>, EventPtr> download(
      const std::vector<at::Tensor>& device_tensors, const HostAllocator& allocate = nullptr) = 0;

  // The random generator that ops on this device draw from.
  virtual at::Generator generator() = 0;
  // Held around compute that touches generator(): sim devices share the CPU
  // generator, so their compute sections take one process-wide lock.
  virtual std::unique_lock<std::mutex> compute_lock() = 0;

  // A timing mark on `queue`, and the device time between two marks of one
  // queue (waits until `end` has completed). Compute marks feed the
  // automatic plan its layer times; upload marks time a copy alone.
  virtual EventPtr record_timing_mark(Queue queue = Queue::kCompute) = 0;
  virtual double seconds_between(const EventPtr& start, const EventPtr& end) = 0;

  virtual DeviceMemoryStats memory_stats() const = 0;
  // Starts memory_stats().peak_bytes over from what is in use now (a
  // benchmark's steady state against the plan's prediction).
  virtual void reset_peak_memory() = 0;
  DeviceTransferStats transfer_stats() const {
    return {uploaded_[0].load(), uploaded_[1].load(), downloaded_.load(), param_copies_.load(),
            largest_param_copy_.load()};
  }
  // Whether host tensors may be pinned for this backend.
  virtual bool supports_pinned_memory() const = 0;

 protected:
  virtual std::pair<std::vector<at::Tensor>, EventPtr> upload_impl(
      Queue queue, const std::vector<at::Tensor>& host, const EventPtr& after,
      StagingRing* staging) = 0;
  // Backends call these from upload() / download().
  void count_upload(Queue queue, const std::vector<at::Tensor>& tensors) {
    uploaded_[queue == Queue::kParamUpload ? 0 : 1] += bytes_of(tensors);
  }
  void count_download(const std::vector<at::Tensor>& tensors) { downloaded_ += bytes_of(tensors); }
  void count_param_chunk(const CopyChunk& chunk) {
    int64_t bytes = 0;
    for (const auto& [dst, src] : chunk) bytes += static_cast<int64_t>(src.nbytes());
    param_copies_ += 1;
    int64_t largest = largest_param_copy_.load();
    while (bytes > largest && !largest_param_copy_.compare_exchange_weak(largest, bytes)) {
    }
  }

 private:
  static int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
    int64_t bytes = 0;
    for (const auto& t : tensors) bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
    return bytes;
  }
  std::atomic<int64_t> uploaded_[2] = {0, 0};
  std::atomic<int64_t> downloaded_{0};
  std::atomic<int64_t> param_copies_{0};
  std::atomic<int64_t> largest_param_copy_{0};
};
using DevicePtr = std::shared_ptr<Device>;

// Allocations a thread bound to a simulated device makes for the host
// inside this scope are not charged to the device's budget (Note
// [Simulated device memory] in sim_device.cpp). Nothing on other backends.
class HostAllocationScope {
 public:
  HostAllocationScope();
  ~HostAllocationScope();
  HostAllocationScope(const HostAllocationScope&) = delete;
  HostAllocationScope& operator=(const HostAllocationScope&) = delete;
};

struct SimDeviceOptions {
  // 0 = unlimited; else uploads and the compute of its threads are charged
  // to it and fail past it (Note [Simulated device memory]).
  int64_t memory_budget_bytes = 0;
  // Upper bound of a random delay before each sim copy, to shake out missing
  // waits in tests (0 = none).
  int64_t copy_jitter_us = 0;
  // Simulated link bandwidth for copies in GB/s (0 = as fast as memcpy).
  double bandwidth_gbps = 0;
  // The largest parameter-upload copy (spec option chunk=SIZE; tests use
  // small ones to exercise the slicing).
  int64_t param_chunk_bytes = kParamUploadChunkBytes;
};

// Makes `count` simulated devices named sim:0..sim:count-1.
std::vector<DevicePtr> make_sim_devices(int count, const SimDeviceOptions& options = {});
// Makes the CUDA devices with the given indices (all visible ones if empty).
// Throws when the build has no CUDA backend or no GPU is visible.
// `memory_cap_bytes` > 0: each device's caching allocator may reserve at
// most that much (its per-process memory fraction), as on a card that size.
std::vector<DevicePtr> make_cuda_devices(const std::vector<int>& indices = {},
                                         int64_t memory_cap_bytes = 0);
bool cuda_backend_compiled();
// Pins existing host memory in place (cudaHostRegister) for fast, truly
// asynchronous copies. Returns false where nothing can be pinned (no CUDA).
bool register_host_memory(void* data, size_t bytes);
void unregister_host_memory(void* data);
int cuda_device_count();

// Parses a device spec: "sim:N" (N simulated devices, optionally followed by
// ",mem=SIZE" e.g. "sim:2,mem=64MiB", ",jitter_us=N", ",gbps=X"), "cuda" (all GPUs),
// "cuda:0,1" (these GPUs), "auto" or "" (all GPUs if any, else sim:1).
std::vector<DevicePtr> make_devices(const std::string& spec);
// The spec in effect when none is given: $ROUNDPIPE_DEVICES, else "auto".
std::string default_device_spec();

// The devices a RoundPipe dispatches to, handed out round-robin.
class DevicePool {
 public:
  explicit DevicePool(std::vector<DevicePtr> devices);
  int size() const { return static_cast<int>(devices_.size()); }
  const DevicePtr& at(int i) const { return devices_.at(i); }
  const std::vector<DevicePtr>& devices() const { return devices_; }
  // Reserves `count` consecutive turns of the round-robin (a call's jobs)
  // and returns the device index of the first.
  int take(int count = 1);

 private:
  std::vector<DevicePtr> devices_;
  std::mutex mu_;
  int cursor_ = 0;
};

}  // namespace roundpipe

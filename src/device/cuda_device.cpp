// The CUDA backend: one stream per queue, c10 CUDA events.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/empty.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "device/memory_budget.h"
#include "device/staging_ring.h"
#include "roundpipe/device.h"
#include "support/trace.h"

namespace roundpipe {
namespace {

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(const c10::cuda::CUDAStream& stream) { event_.record(stream); }
  void synchronize() override { event_.synchronize(); }
  bool query() override { return event_.query(); }
  void block(const c10::cuda::CUDAStream& stream) { event_.block(stream); }

 private:
  at::cuda::CUDAEvent event_;
};

// An event with timing enabled.
class CudaTimingMark final : public Event {
 public:
  explicit CudaTimingMark(const c10::cuda::CUDAStream& stream) : event_(cudaEventDefault) {
    event_.record(stream);
  }
  void synchronize() override { event_.synchronize(); }
  bool query() override { return event_.query(); }
  double seconds_since(CudaTimingMark& start) {
    event_.synchronize();
    return start.event_.elapsed_time(event_) / 1000.0;
  }

 private:
  at::cuda::CUDAEvent event_;
};

// The cap the process set on a device (its per-process fraction), and the
// lower fraction the engine set in its place (Note [Device memory
// budget]): a second engine on the device must start from the process's
// cap, not from the fraction the first one lowered it to.
struct CapRecord {
  double set_by_us = 0;  // the fraction we set (0: none)
  int64_t cap_bytes = 0;
};
std::mutex caps_mu;
std::map<int, CapRecord> caps;

// Reads the device's memory and, under a cap, lowers the caching
// allocator's fraction to what the process may use (Note [Device memory
// budget]). Returns that cap (0: none).
// The device's memory now, with `cap_bytes` as the process's cap.
DeviceMemoryReading read_device_memory(c10::DeviceIndex index, int64_t cap_bytes) {
  size_t free_bytes = 0, total_bytes = 0;
  {
    c10::cuda::CUDAGuard guard(index);
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  }
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  return {static_cast<int64_t>(total_bytes), static_cast<int64_t>(free_bytes),
          stats.reserved_bytes[0].current, cap_bytes};
}

int64_t take_capped_budget(c10::DeviceIndex index) {
  auto reading = read_device_memory(index, 0);
  const auto total = reading.total_bytes;
  const double fraction = c10::cuda::CUDACachingAllocator::getMemoryFraction(index);
  std::lock_guard<std::mutex> lock(caps_mu);
  auto& record = caps[index];
  if (record.set_by_us == 0 || fraction != record.set_by_us) {  // the process's own cap
    record.cap_bytes = fraction > 0 && fraction < 1
                           ? static_cast<int64_t>(fraction * static_cast<double>(total))
                           : 0;
    record.set_by_us = 0;
  }
  if (record.cap_bytes == 0) return 0;
  reading.cap_bytes = record.cap_bytes;
  const int64_t usable = usable_device_bytes(reading);
  const double lowered =
      static_cast<double>(allocator_limit_bytes(usable)) / static_cast<double>(total);
  if (lowered < fraction) {
    c10::cuda::CUDACachingAllocator::setMemoryFraction(lowered, index);
    record.set_by_us = c10::cuda::CUDACachingAllocator::getMemoryFraction(index);
  }
  return record.cap_bytes;
}

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int index) : index_(static_cast<c10::DeviceIndex>(index)) {
    // LibTorch sets up CUDA (and its caching allocator) on the first CUDA
    // tensor; memory_stats() may be asked before any, when the engine takes
    // its default memory limit, and the allocator's stats need it set up.
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    cap_bytes_ = take_capped_budget(index_);
    for (int q = 0; q < 4; ++q) {
      // Activation uploads are on the critical path: give them priority.
      streams_[q] = c10::cuda::getStreamFromPool(q == static_cast<int>(Queue::kActUpload), index_);
    }
    releaser_ = std::thread([this] { release_loop(); });
  }
  ~CudaDevice() override {
    {
      std::lock_guard<std::mutex> lock(held_mu_);
      stopping_ = true;
      held_cv_.notify_all();
    }
    releaser_.join();  // after releasing what is still held, in order
  }

  std::string name() const override { return "cuda:" + std::to_string(index_); }
  c10::Device torch_device() const override { return c10::Device(c10::kCUDA, index_); }
  bool is_simulated() const override { return false; }

  void bind_compute_thread() override {
    // force: make the device's context current on this thread even when the
    // device index already matches (cuBLAS otherwise finds no context).
    c10::cuda::set_device(index_, /*force=*/true);
    c10::cuda::setCurrentCUDAStream(stream(Queue::kCompute));
  }

  void enqueue(Queue queue, std::function<void()> work) override {
    c10::cuda::CUDAStreamGuard guard(stream(queue));
    work();
  }
  EventPtr record_timing_mark(Queue queue) override {
    c10::cuda::CUDAGuard guard(index_);
    return std::make_shared<CudaTimingMark>(stream(queue));
  }
  double seconds_between(const EventPtr& start, const EventPtr& end) override {
    auto* a = dynamic_cast<CudaTimingMark*>(start.get());
    auto* b = dynamic_cast<CudaTimingMark*>(end.get());
    TORCH_CHECK(a && b, name(), ": seconds_between needs two timing marks of this device");
    c10::cuda::CUDAGuard guard(index_);
    return b->seconds_since(*a);
  }

  EventPtr record(Queue queue) override {
    c10::cuda::CUDAGuard guard(index_);
    return std::make_shared<CudaEvent>(stream(queue));
  }
  void wait(Queue queue, const EventPtr& event) override {
    if (!event) return;
    auto* cuda_event = dynamic_cast<CudaEvent*>(event.get());
    TORCH_CHECK(cuda_event, name(), ": cannot wait on an event of another backend");
    cuda_event->block(stream(queue));
  }

  std::pair<std::vector<at::Tensor>, EventPtr> upload_impl(Queue queue,
                                                           const std::vector<at::Tensor>& host,
                                                           const EventPtr& after,
                                                           StagingRing* staging) override {
    std::vector<at::Tensor> dst;
    dst.reserve(host.size());
    // (Traced: how long the allocations took and how often the caching
    // allocator released its cached blocks for them, which synchronises the
    // device: Note [Uploads that wait on the allocator].)
    const bool traced = detail::tracing();
    const auto alloc_start = std::chrono::steady_clock::now();
    const int64_t releases_before = traced ? allocator_releases() : 0;
    {
      // Allocated in the upload stream's order and marked as used by the
      // compute stream: the caching allocator hands the memory out again
      // only once both streams have passed its last use. So the copy waits
      // for nothing the compute stream does (waiting for all compute
      // enqueued so far would serialise a prefetch behind the running stage).
      c10::cuda::CUDAStreamGuard guard(stream(queue));
      for (const auto& t : host) {
        dst.push_back(
            at::empty(t.sizes(), t.options().device(torch_device()).pinned_memory(false)));
        c10::cuda::CUDACachingAllocator::recordStream(dst.back().storage().data_ptr(),
                                                      stream(Queue::kCompute));
      }
    }
    if (traced)
      ROUNDPIPE_TRACE("%s: %s upload of %zu tensors allocated in %.1f ms, %lld allocator releases",
                      name().c_str(), queue == Queue::kParamUpload ? "parameter" : "activation",
                      host.size(), detail::ms_since(alloc_start),
                      static_cast<long long>(allocator_releases() - releases_before));
    count_upload(queue, host);
    wait(queue, after);
    {
      c10::cuda::CUDAStreamGuard guard(stream(queue));
      if (queue == Queue::kParamUpload) {
        // Copies of at most kParamUploadChunkBytes: between two of them the
        // copy engine can serve the activation-upload stream.
        const int64_t chunk_bytes = staging
                                        ? std::min(kParamUploadChunkBytes, staging->slot_bytes())
                                        : kParamUploadChunkBytes;
        for (const auto& chunk : copy_chunks(dst, host, chunk_bytes)) {
          count_param_chunk(chunk);
          const bool pageable = staging && std::any_of(chunk.begin(), chunk.end(), [](auto& c) {
                                  return !c.second.is_pinned();
                                });
          if (!pageable) {
            for (const auto& [d, s] : chunk) d.copy_(s, /*non_blocking=*/true);
            continue;
          }
          auto staged = staging->stage(chunk);
          for (const auto& [d, s] : staged.chunk) d.copy_(s, /*non_blocking=*/true);
          staging->release(staged.slot, record(queue));
        }
      } else {
        for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(host[i], /*non_blocking=*/true);
      }
    }
    hold_until_copied(queue, host);
    return {dst, record(queue)};
  }

  std::pair<std::vector<at::Tensor>, EventPtr> download(
      const std::vector<at::Tensor>& device_tensors, const HostAllocator& allocate) override {
    count_download(device_tensors);
    wait(Queue::kDownload, record(Queue::kCompute));
    std::vector<at::Tensor> dst;
    dst.reserve(device_tensors.size());
    c10::cuda::CUDAStreamGuard guard(stream(Queue::kDownload));
    for (const auto& t : device_tensors) {
      auto host = allocate
                      ? allocate(t.sizes(), t.scalar_type())
                      : at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true));
      host.copy_(t, /*non_blocking=*/true);
      // The compute side may free `t` before this copy has read it.
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(),
                                                    stream(Queue::kDownload));
      dst.push_back(host);
    }
    hold_until_copied(Queue::kDownload, dst);
    return {dst, record(Queue::kDownload)};
  }

  at::Generator generator() override {
    return at::globalContext().defaultGenerator(torch_device());
  }
  std::unique_lock<std::mutex> compute_lock() override { return {}; }

  DeviceMemoryStats memory_stats() const override {
    // What this process may hold (Note [Device memory budget]): a 24 GiB
    // card and a big card capped to 24 GiB give the same budget.
    const int64_t budget = usable_device_bytes(read_device_memory(index_, cap_bytes_));
    const auto all = c10::cuda::CUDACachingAllocator::getDeviceStats(index_).allocated_bytes[0];
    return {budget, all.current, all.peak};
  }
  void reset_peak_memory() override { c10::cuda::CUDACachingAllocator::resetPeakStats(index_); }
  bool supports_pinned_memory() const override { return true; }

 private:
  const c10::cuda::CUDAStream& stream(Queue q) const { return streams_[static_cast<int>(q)]; }

  // Note [Uploads that wait on the allocator]
  // The caching allocator keeps a stream's freed blocks for that stream.
  // Parameters arrive on the upload stream; activations come and go on the
  // compute stream. When a stage's parameters need more than the upload
  // stream has cached and the cap leaves no room for a new segment, the
  // allocator releases every cached block (num_alloc_retries) and that
  // synchronises the device: the upload then starts only once all compute
  // enqueued so far has finished, and the GPU waits for it. ROUNDPIPE_TRACE
  // prints each upload's allocation time and releases to tell this apart
  // from waiting for the weights.
  int64_t allocator_releases() const {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(index_).num_alloc_retries;
  }

  // Keeps the host side of the copies just enqueued on `queue` referenced
  // until they have completed (see Device::download): the releaser thread
  // drops them then, in order. Its events block without spinning, so the
  // thread sleeps while copies run.
  struct Held {
    at::cuda::CUDAEvent done{cudaEventDisableTiming | cudaEventBlockingSync};
    std::vector<at::Tensor> host;
  };
  void hold_until_copied(Queue queue, const std::vector<at::Tensor>& host) {
    Held held;
    held.done.record(stream(queue));
    held.host = host;
    std::lock_guard<std::mutex> lock(held_mu_);
    held_.push_back(std::move(held));
    held_cv_.notify_one();
  }
  void release_loop() {
    c10::cuda::set_device(index_);
    for (;;) {
      Held held;
      {
        std::unique_lock<std::mutex> lock(held_mu_);
        held_cv_.wait(lock, [&] { return stopping_ || !held_.empty(); });
        if (held_.empty()) return;
        held = std::move(held_.front());
        held_.pop_front();
      }
      try {
        held.done.synchronize();
      } catch (...) {
        // The driver is shutting down: no copy runs any more.
      }
    }  // `held` goes here: its host memory may be reused
  }

  c10::DeviceIndex index_;
  int64_t cap_bytes_ = 0;  // the process's cap on this device (0: none)
  std::mutex held_mu_;
  std::condition_variable held_cv_;
  std::deque<Held> held_;
  bool stopping_ = false;
  std::thread releaser_;
  std::array<c10::cuda::CUDAStream, 4> streams_ = {
      c10::cuda::getDefaultCUDAStream(), c10::cuda::getDefaultCUDAStream(),
      c10::cuda::getDefaultCUDAStream(), c10::cuda::getDefaultCUDAStream()};
};

}  // namespace

bool cuda_backend_compiled() {
  return true;
}

bool register_host_memory(void* data, size_t bytes) {
  if (cuda_device_count() == 0 || bytes == 0) return false;
  const cudaError_t status = cudaHostRegister(data, bytes, cudaHostRegisterDefault);
  if (status == cudaErrorHostMemoryAlreadyRegistered) {
    (void)cudaGetLastError();  // clear it: the memory is pinned already
    return false;
  }
  C10_CUDA_CHECK(status);
  return true;
}

void unregister_host_memory(void* data) {
  const cudaError_t status = cudaHostUnregister(data);
  if (status != cudaSuccess) (void)cudaGetLastError();  // best effort at teardown
}

int cuda_device_count() {
  return static_cast<int>(c10::cuda::device_count());
}

// Note [Expandable segments]
// The engine's device allocations change size from call to call (a stage's
// parameters, a microbatch's activations at the length its batch has), and
// a 12-24 GiB card has little room to spare: with the caching allocator's
// fixed segments, GiBs end up reserved but unusable (a 12 GiB cap ran out
// of memory with 2.5 GiB reserved and unallocated). Expandable segments map
// physical memory into one growing segment instead. They are turned on when
// the engine makes its CUDA devices, unless the process configured them
// (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF, or the allocator settings
// set at run time, naming expandable_segments: "expandable_segments:False"
// keeps them off). Segments the process already has stay as they are.
void use_expandable_segments_unless_configured() {
  for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && std::string(value).find("expandable_segments") != std::string::npos)
      return;
  }
  if (c10::CachingAllocator::getAllocatorSettings().find("expandable_segments") !=
      std::string::npos)
    return;
  c10::CachingAllocator::setAllocatorSettings("expandable_segments:True");
}

std::vector<DevicePtr> make_cuda_devices(const std::vector<int>& indices_in,
                                         int64_t memory_cap_bytes) {
  const int count = cuda_device_count();
  TORCH_CHECK(count > 0,
              "no CUDA GPU is visible. Use ROUNDPIPE_DEVICES=sim:N to run on "
              "simulated devices.");
  use_expandable_segments_unless_configured();
  std::vector<int> indices = indices_in;
  if (indices.empty()) {
    for (int i = 0; i < count; ++i) indices.push_back(i);
  }
  // The caching allocator must be set up before its fraction is set (the
  // Python package may get here before torch touched CUDA: "Allocator not
  // initialized for device").
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  std::vector<DevicePtr> devices;
  for (int i : indices) {
    TORCH_CHECK(i >= 0 && i < count, "GPU index ", i, " is out of range: ", count,
                " GPU(s) are visible");
    if (memory_cap_bytes > 0) {
      // The per-process fraction, as torch.cuda.set_per_process_memory_fraction
      // sets it: the default memory limit then follows (memory_stats()).
      size_t free_bytes = 0, total_bytes = 0;
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(i));
      C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      const double fraction =
          std::min(1.0, static_cast<double>(memory_cap_bytes) / static_cast<double>(total_bytes));
      c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction,
                                                         static_cast<c10::DeviceIndex>(i));
    }
    devices.push_back(std::make_shared<CudaDevice>(i));
  }
  return devices;
}

}  // namespace roundpipe

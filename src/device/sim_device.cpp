// The simulated accelerator: CPU tensors, copy queues on real threads.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include "device/staging_ring.h"
#include "roundpipe/device.h"

namespace roundpipe {
namespace {

// A moment of a queue: now for the (inline) compute queue, when the queue's
// thread reaches it for a copy queue.
class SimTimingMark final : public Event {
 public:
  void stamp() {
    std::lock_guard<std::mutex> lock(mu_);
    time_ = std::chrono::steady_clock::now();
    done_ = true;
    cv_.notify_all();
  }
  void synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
  }
  bool query() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  std::chrono::steady_clock::time_point time() {
    synchronize();
    return time_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point time_;
};

class SimEvent final : public Event {
 public:
  void complete(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = error;
    cv_.notify_all();
  }
  void synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  bool query() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

std::shared_ptr<SimEvent> completed_event() {
  auto event = std::make_shared<SimEvent>();
  event->complete(nullptr);
  return event;
}

// One ordered queue served by its own thread. A task that throws poisons the
// next recorded event, so whoever waits on it sees the error.
class SimQueue {
 public:
  SimQueue(std::string name, int64_t jitter_us) : name_(std::move(name)), jitter_us_(jitter_us) {
    thread_ = std::thread([this] { loop(); });
  }
  ~SimQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    thread_.join();
  }
  void push(std::function<void()> task, bool jitter) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back({std::move(task), jitter});
    cv_.notify_all();
  }
  EventPtr record() {
    auto event = std::make_shared<SimEvent>();
    push(
        [this, event] {
          event->complete(error_);
          error_ = nullptr;
        },
        false);
    return event;
  }

 private:
  struct Task {
    std::function<void()> fn;
    bool jitter;
  };
  void loop() {
    std::mt19937_64 rng(std::hash<std::string>{}(name_));
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      if (task.jitter && jitter_us_ > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % (jitter_us_ + 1)));
      }
      try {
        task.fn();
      } catch (...) {
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  std::string name_;
  int64_t jitter_us_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  bool stop_ = false;
  std::exception_ptr error_;  // touched by the queue thread only
  std::thread thread_;
};

// Note [Simulated device memory]
// A simulated device's memory is host memory charged to its budget: the
// tensors it uploads into, and, while a thread works for it (its worker and
// uploader, bound by bind_compute_thread()), every CPU allocation that
// thread makes: compute's activations, gradients and workspaces, through a
// CPU allocator that wraps LibTorch's, installed when the first budgeted
// device is made. A charge past the budget throws c10::OutOfMemoryError, as
// a card's caching allocator does; a free, on whatever thread, credits the
// device it was charged to. What such a thread allocates for the host (a
// download's destination, a buffer snapshot) is made inside a
// HostAllocationScope and charged to nothing.
// Every device allocation and free is also reported to the thread's memory
// reporter (c10::reportMemoryUsageToProfiler), as the CUDA caching allocator
// reports its own: that is what the engine's AllocationMeter reads on any
// device. A device without a budget is charged too, with no limit: its
// memory_stats() then say what it used.
struct SimMemory {
  std::string name;
  std::atomic<int64_t> in_use{0};
  std::atomic<int64_t> peak{0};
  int64_t budget = 0;

  // Charges `bytes`, or throws OutOfMemoryError past the budget.
  void charge(int64_t bytes) {
    const int64_t now = in_use.fetch_add(bytes) + bytes;
    if (budget > 0 && now > budget) {
      in_use.fetch_sub(bytes);
      TORCH_CHECK_WITH(OutOfMemoryError, false, name, " out of memory: tried to allocate ", bytes,
                       " bytes with ", now - bytes, " of ", budget,
                       " bytes in use. Use smaller stages (execute_plan), more microbatches or "
                       "recompute_grain=layer, or give the simulated device a larger budget.");
    }
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
  }
};

thread_local std::shared_ptr<SimMemory> charged_memory;  // the device this thread works for
thread_local int host_allocation_depth = 0;

// LibTorch's CPU allocator, with the allocations of threads bound to a
// simulated device charged (and reported) to it.
// Every allocation keeps LibTorch's own CPU allocation and deleter, with
// data == context, so that LibTorch's raw_allocate / raw_deallocate (which
// some CPU kernels use for scratch memory) work through it; a charged one
// is also entered in a table that its free credits back.
class ChargingCpuAllocator final : public c10::Allocator {
 public:
  explicit ChargingCpuAllocator(c10::Allocator* inner)
      : inner_(inner), inner_delete_(inner->raw_deleter()) {
    TORCH_INTERNAL_ASSERT(inner_delete_ != nullptr,
                          "the CPU allocator to charge has no raw deleter");
    self_ = this;
  }
  c10::DataPtr allocate(size_t n) override {
    const auto& memory = charged_memory;
    const bool charge = memory && host_allocation_depth == 0;
    const auto bytes = static_cast<int64_t>(n);
    if (charge) memory->charge(bytes);
    c10::DataPtr inner;
    try {
      inner = inner_->allocate(n);
    } catch (...) {
      if (charge) memory->in_use.fetch_sub(bytes);
      throw;
    }
    const auto device = inner.device();
    void* data = inner.release_context();  // now ours to free with inner_delete_
    if (charge && data != nullptr) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        charges_[data] = Charge{memory, bytes};
        charged_count_.fetch_add(1);
      }
      c10::reportMemoryUsageToProfiler(data, bytes, 0, 0, device);
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  struct Charge {
    std::shared_ptr<SimMemory> memory;
    int64_t bytes;
  };
  static void release(void* data) {
    auto* self = self_;
    if (self->charged_count_.load() > 0) {
      std::shared_ptr<SimMemory> memory;
      int64_t bytes = 0;
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        auto it = self->charges_.find(data);
        if (it != self->charges_.end()) {
          memory = std::move(it->second.memory);
          bytes = it->second.bytes;
          self->charges_.erase(it);
          self->charged_count_.fetch_sub(1);
        }
      }
      if (memory) {
        memory->in_use.fetch_sub(bytes);
        c10::reportMemoryUsageToProfiler(data, -bytes, 0, 0, c10::Device(c10::kCPU));
      }
    }
    self->inner_delete_(data);
  }
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_delete_;
  std::mutex mu_;
  std::unordered_map<void*, Charge> charges_;
  std::atomic<int64_t> charged_count_{0};
  static inline ChargingCpuAllocator* self_ = nullptr;
};

void install_charging_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static ChargingCpuAllocator charging(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&charging, /*priority=*/100);
  });
}

// Note [Host kernel caches]
// On a CPU with AVX-512, LibTorch runs bfloat16 matmuls and attention
// through oneDNN, which keeps what it makes for each shape in two caches of
// 1,024 entries each: oneDNN's primitive cache (the compiled kernels) and
// the ideep LRU cache of LibTorch's mkldnn ops (the objects around them).
// Packed rows of varying length make new shapes every step, so a process
// training on simulated devices grew by some 700 MiB over its first ~1,000
// steps and then levelled off (issue 33). bench/host_memory_probe.py on the
// GPU machine's CPU (a tiny Qwen3 in bfloat16, rows of 8-128 tokens, growth
// from step 40 to 400): both caches at 1,024 entries +658 MiB (1,333 ->
// 1,991); oneDNN's at 128 and ideep's at 8 +38 MiB (951 -> 989, at the same
// 47 ms a step); both at 8 +20 MiB but 105 ms a step (kernels compiled
// again within each step). The first simulated device sets oneDNN's at 128
// (a step's kernels) and ideep's at 8, unless the process set them. The
// caches read their capacity at their first use, so a process that ran such
// a kernel before keeps what it had then.
void limit_host_kernel_caches() {
  static std::once_flag once;
  std::call_once(once, [] {
    const bool onednn_set = std::getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY") != nullptr ||
                            std::getenv("DNNL_PRIMITIVE_CACHE_CAPACITY") != nullptr;
    if (!onednn_set) setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128", 0);
    setenv("LRU_CACHE_CAPACITY", "8", /*overwrite=*/0);
  });
}

std::mutex& sim_compute_mutex() {
  static std::mutex mu;
  return mu;
}

class SimDevice final : public Device {
 public:
  SimDevice(int index, const SimDeviceOptions& options)
      : index_(index), options_(options), memory_(std::make_shared<SimMemory>()) {
    memory_->name = name();
    memory_->budget = options.memory_budget_bytes;
    install_charging_allocator();
    limit_host_kernel_caches();
    for (Queue q : {Queue::kParamUpload, Queue::kActUpload, Queue::kDownload}) {
      queues_[static_cast<int>(q)] =
          std::make_unique<SimQueue>(name() + "/" + queue_name(q), options.copy_jitter_us);
    }
  }

  std::string name() const override { return "sim:" + std::to_string(index_); }
  c10::Device torch_device() const override { return c10::Device(c10::kCPU); }
  bool is_simulated() const override { return true; }

  void bind_compute_thread() override { charged_memory = memory_; }

  void enqueue(Queue queue, std::function<void()> work) override {
    if (queue == Queue::kCompute) {
      work();
    } else {
      copy_queue(queue).push(std::move(work), false);
    }
  }
  EventPtr record_timing_mark(Queue queue) override {
    auto mark = std::make_shared<SimTimingMark>();
    if (queue == Queue::kCompute) {
      mark->stamp();  // compute runs inline: now is when it is done
    } else {
      copy_queue(queue).push([mark] { mark->stamp(); }, false);
    }
    return mark;
  }
  double seconds_between(const EventPtr& start, const EventPtr& end) override {
    auto* a = dynamic_cast<SimTimingMark*>(start.get());
    auto* b = dynamic_cast<SimTimingMark*>(end.get());
    TORCH_CHECK(a && b, name(), ": seconds_between needs two timing marks of this device");
    return std::chrono::duration<double>(b->time() - a->time()).count();
  }

  EventPtr record(Queue queue) override {
    if (queue == Queue::kCompute) return completed_event();
    return copy_queue(queue).record();
  }
  void wait(Queue queue, const EventPtr& event) override {
    if (!event) return;
    if (queue == Queue::kCompute) {
      event->synchronize();
    } else {
      copy_queue(queue).push([event] { event->synchronize(); }, false);
    }
  }

  std::pair<std::vector<at::Tensor>, EventPtr> upload_impl(Queue queue,
                                                           const std::vector<at::Tensor>& host,
                                                           const EventPtr& after,
                                                           StagingRing* staging) override {
    TORCH_CHECK(queue == Queue::kParamUpload || queue == Queue::kActUpload,
                "upload runs on an upload queue, not ", queue_name(queue));
    std::vector<at::Tensor> dst;
    dst.reserve(host.size());
    for (const auto& t : host) dst.push_back(allocate(t.sizes(), t.scalar_type()));
    count_upload(queue, host);
    wait(queue, after);
    if (queue == Queue::kParamUpload) {
      // One queue task per chunk, as the CUDA backend issues one copy each;
      // with a staging ring, from its slot (nothing is pinned here: every
      // chunk goes through it).
      const int64_t chunk_bytes = staging
                                      ? std::min(options_.param_chunk_bytes, staging->slot_bytes())
                                      : options_.param_chunk_bytes;
      for (auto& chunk : copy_chunks(dst, host, chunk_bytes)) {
        count_param_chunk(chunk);
        int slot = -1;
        if (staging) {
          auto staged = staging->stage(chunk);
          chunk = std::move(staged.chunk);
          slot = staged.slot;
        }
        copy_queue(queue).push(
            [chunk = std::move(chunk), this] {  // the slices keep the storages alive
              std::vector<at::Tensor> to, from;
              for (const auto& [d, s] : chunk) {
                to.push_back(d);
                from.push_back(s);
              }
              copy_all(to, from);
            },
            true);
        if (slot >= 0) staging->release(slot, record(queue));
      }
    } else {
      copy_queue(queue).push([dst, host, this] { copy_all(dst, host); }, true);
    }
    return {dst, record(queue)};
  }

  std::pair<std::vector<at::Tensor>, EventPtr> download(
      const std::vector<at::Tensor>& device_tensors, const HostAllocator& allocate) override {
    HostAllocationScope host;  // the destinations are host memory
    std::vector<at::Tensor> dst;
    dst.reserve(device_tensors.size());
    for (const auto& t : device_tensors) {
      dst.push_back(allocate ? allocate(t.sizes(), t.scalar_type())
                             : at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type())));
    }
    count_download(device_tensors);
    copy_queue(Queue::kDownload)
        .push([dst, device_tensors, this] { copy_all(dst, device_tensors); }, true);
    return {dst, record(Queue::kDownload)};
  }

  at::Generator generator() override { return at::detail::getDefaultCPUGenerator(); }
  std::unique_lock<std::mutex> compute_lock() override {
    return std::unique_lock<std::mutex>(sim_compute_mutex());
  }
  DeviceMemoryStats memory_stats() const override {
    return {memory_->budget, memory_->in_use.load(), memory_->peak.load()};
  }
  void reset_peak_memory() override { memory_->peak = memory_->in_use.load(); }
  bool supports_pinned_memory() const override { return false; }

 private:
  SimQueue& copy_queue(Queue q) { return *queues_[static_cast<int>(q)]; }

  // A tensor in the simulated device memory: counted against the budget from
  // allocation until its storage is freed.
  at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype) {
    int64_t numel = 1;
    for (auto s : sizes) numel *= s;
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    memory_->charge(bytes);
    void* data = c10::alloc_cpu(std::max<int64_t>(bytes, 1));
    c10::reportMemoryUsageToProfiler(data, bytes, 0, 0, c10::Device(c10::kCPU));
    auto memory = memory_;
    return at::from_blob(
        data, sizes,
        [memory, bytes](void* p) {
          c10::reportMemoryUsageToProfiler(p, -bytes, 0, 0, c10::Device(c10::kCPU));
          c10::free_cpu(p);
          memory->in_use.fetch_sub(bytes);
        },
        at::TensorOptions().dtype(dtype));
  }

  void copy_all(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
    const auto start = std::chrono::steady_clock::now();
    int64_t bytes = 0;
    for (size_t i = 0; i < dst.size(); ++i) {
      dst[i].copy_(src[i]);
      bytes += src[i].nbytes();
    }
    if (options_.bandwidth_gbps > 0) {
      const auto target = std::chrono::duration<double>(bytes / (options_.bandwidth_gbps * 1e9));
      std::this_thread::sleep_until(start +
                                    std::chrono::duration_cast<std::chrono::nanoseconds>(target));
    }
  }

  int index_;
  SimDeviceOptions options_;
  std::shared_ptr<SimMemory> memory_;
  std::array<std::unique_ptr<SimQueue>, 4> queues_;
};

}  // namespace

HostAllocationScope::HostAllocationScope() {
  ++host_allocation_depth;
}
HostAllocationScope::~HostAllocationScope() {
  --host_allocation_depth;
}

const char* queue_name(Queue q) {
  switch (q) {
    case Queue::kParamUpload:
      return "param-upload";
    case Queue::kActUpload:
      return "activation-upload";
    case Queue::kCompute:
      return "compute";
    case Queue::kDownload:
      return "download";
  }
  return "?";
}

std::vector<DevicePtr> make_sim_devices(int count, const SimDeviceOptions& options) {
  TORCH_CHECK(count >= 1, "make_sim_devices: need at least one device, got ", count);
  std::vector<DevicePtr> devices;
  for (int i = 0; i < count; ++i) devices.push_back(std::make_shared<SimDevice>(i, options));
  return devices;
}

}  // namespace roundpipe

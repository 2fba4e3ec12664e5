// HostArena: see host_arena.h.
#include "runtime/memory/host_arena.h"

#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "roundpipe/device.h"
#include "support/trace.h"

namespace roundpipe {
namespace {

// A chunk's free space: blocks by offset (to coalesce neighbours) and by
// (size, offset) (best fit: the smallest that is large enough, lowest offset
// among equals).
struct HostArenaChunk {
  char* base = nullptr;
  int64_t size = 0;
  bool pinned = false;
  // Note [Idle arena chunks go back]: whether a block was taken from it
  // since the last release pass, and how many passes in a row found it
  // entirely free and untouched.
  bool taken = false;
  int idle_passes = 0;
  std::map<int64_t, int64_t> free_at;
  std::set<std::pair<int64_t, int64_t>> free_by_size;

  void add_free(int64_t offset, int64_t bytes) {
    free_at.emplace(offset, bytes);
    free_by_size.emplace(bytes, offset);
  }
  void remove_free(std::map<int64_t, int64_t>::iterator it) {
    free_by_size.erase({it->second, it->first});
    free_at.erase(it);
  }
  bool entirely_free() const { return free_at.size() == 1 && free_at.begin()->second == size; }
};

void free_chunk(const HostArenaChunk& chunk) {
  if (chunk.pinned) unregister_host_memory(chunk.base);
  std::free(chunk.base);
}

// Note [Pinned chunks go back off the caller's thread]
// Unpinning (cudaHostUnregister) waits until the device has finished all
// its work, as freeing pinned memory does. Called where a call starts, it
// kept the training loop from queueing the next call until the previous
// one had drained the GPU: 0.7-1.9 s a call at the Llama-3.2-3B shape
// (ROUNDPIPE_TRACE, "starts after ... waiting for earlier calls"), with
// the GPU idle meanwhile. Chunks taken out of the arena are therefore
// unpinned and freed on a thread of their own (pinned or not: one path,
// which the simulated devices run too); the arena's accounting drops them
// at once, the process's resident memory once the thread has freed them.
class ChunkReleaser {
 public:
  ~ChunkReleaser() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    for (const auto& chunk : queue_) free_chunk(*chunk);  // where no thread could start
  }

  void post(std::vector<std::unique_ptr<HostArenaChunk>> chunks) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& chunk : chunks) queue_.push_back(std::move(chunk));
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    detail::trace_who = "host arena releaser";
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to free
      auto chunk = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      const auto start = std::chrono::steady_clock::now();
      free_chunk(*chunk);
      ROUNDPIPE_TRACE("host arena: freed a chunk of %.1f MiB in %.1f ms",
                      static_cast<double>(chunk->size) / (1 << 20), detail::ms_since(start));
      chunk.reset();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<HostArenaChunk>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

struct HostArena::State {
  // What a block's DataPtr carries: returning it needs the state alive.
  struct Block {
    std::shared_ptr<State> state;
    HostArenaChunk* chunk = nullptr;
    int64_t offset = 0;
    int64_t bytes = 0;
  };

  explicit State(const HostArenaOptions& o) : options(o) {}
  ~State() {
    for (auto& chunk : chunks) free_chunk(*chunk);
    // releaser (a member) then frees what it still has queued, and stops.
  }

  int64_t round_up(int64_t bytes) const {
    TORCH_CHECK(bytes >= 0, "HostArena: a request of ", bytes, " bytes; sizes must be >= 0");
    const int64_t mask = options.alignment - 1;
    TORCH_CHECK(bytes <= std::numeric_limits<int64_t>::max() - mask, "HostArena: a request of ",
                bytes, " bytes is too large");
    return (bytes + mask) & ~mask;
  }

  // Takes a new chunk of `bytes` (a multiple of the alignment). Under mu.
  HostArenaChunk& add_chunk(int64_t bytes) {
    chunks.reserve(chunks.size() + 1);  // the push_back below cannot throw
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t align = std::max(static_cast<size_t>(options.alignment), page);
    void* data = nullptr;
    const int rc = posix_memalign(&data, align, static_cast<size_t>(bytes));
    // A plain error, not c10::OutOfMemoryError: that one means the device's
    // memory, and makes the automatic plan smaller (Note [Out-of-memory
    // redo]), which cannot help the host.
    TORCH_CHECK(rc == 0 && data != nullptr, "HostArena: cannot allocate a host memory chunk of ",
                bytes, " bytes (", stats.reserved_bytes,
                " bytes reserved already): the host is out of memory. Free host memory, or use "
                "pin_model=register or off to keep the model's own storage.");
    auto chunk = std::make_unique<HostArenaChunk>();
    chunk->base = static_cast<char*>(data);
    chunk->size = bytes;
    if (options.pin) {
      const auto start = std::chrono::steady_clock::now();
      try {
        chunk->pinned = register_host_memory(data, static_cast<size_t>(bytes));
      } catch (...) {
        std::free(data);
        throw;
      }
      ROUNDPIPE_TRACE("host arena: a new chunk of %.1f MiB pinned in %.1f ms (%.2f GiB reserved)",
                      static_cast<double>(bytes) / (1 << 20), detail::ms_since(start),
                      static_cast<double>(stats.reserved_bytes + bytes) / (1 << 30));
    }
    chunk->add_free(0, bytes);
    stats.reserved_bytes += bytes;
    if (chunk->pinned) stats.pinned_bytes += bytes;
    stats.chunks += 1;
    chunks.push_back(std::move(chunk));
    return *chunks.back();
  }

  c10::DataPtr allocate(const std::shared_ptr<State>& self, int64_t bytes) {
    const int64_t need = round_up(bytes);
    if (need == 0) return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
    auto block = std::make_unique<Block>();
    block->state = self;
    std::lock_guard<std::mutex> lock(mu);
    HostArenaChunk* best = nullptr;
    std::pair<int64_t, int64_t> fit;
    for (auto& chunk : chunks) {
      auto it = chunk->free_by_size.lower_bound({need, 0});
      if (it != chunk->free_by_size.end() && (best == nullptr || it->first < fit.first)) {
        best = chunk.get();
        fit = *it;
      }
    }
    if (best == nullptr) {
      best = &add_chunk(std::max(round_up(options.chunk_bytes), need));
      fit = {best->size, 0};
    }
    best->taken = true;
    best->remove_free(best->free_at.find(fit.second));
    if (fit.first > need) best->add_free(fit.second + need, fit.first - need);
    stats.allocated_bytes += need;
    stats.peak_allocated_bytes = std::max(stats.peak_allocated_bytes, stats.allocated_bytes);
    stats.live_blocks += 1;
    block->chunk = best;
    block->offset = fit.second;
    block->bytes = need;
    void* data = best->base + fit.second;
    return c10::DataPtr(data, block.release(), &State::release, c10::Device(c10::kCPU));
  }

  // Returns a block, merged with the free blocks on either side.
  void give_back(HostArenaChunk& chunk, int64_t offset, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    int64_t start = offset, size = bytes;
    auto next = chunk.free_at.lower_bound(offset);
    if (next != chunk.free_at.end() && next->first == offset + bytes) {
      size += next->second;
      auto after = std::next(next);
      chunk.remove_free(next);
      next = after;
    }
    if (next != chunk.free_at.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        start = prev->first;
        size += prev->second;
        chunk.remove_free(prev);
      }
    }
    chunk.add_free(start, size);
    stats.allocated_bytes -= bytes;
    stats.live_blocks -= 1;
  }

  static void release(void* context) {
    std::unique_ptr<Block> block(static_cast<Block*>(context));
    block->state->give_back(*block->chunk, block->offset, block->bytes);
    // Destroying `block` may drop the last reference to the state: that frees
    // the chunks, outside the lock.
  }

  // Note [Idle arena chunks go back]
  // A call can need more host memory than the calls after it: the first one
  // keeps more layer inputs on the host (its plan has not measured
  // activations yet; in layer-from-stage grain it sends the rerun's inputs
  // there too), and a retry by layer after a device out-of-memory error
  // does the same. Chunks kept for good hold the process at that peak:
  // 14.98 GiB of staging and downloads in a 32B NF4 run whose later calls
  // need a few. So each call's start makes a pass: a chunk no block was
  // taken from since the last pass, and entirely free now, counts one idle
  // pass; after `passes` of them in a row it goes back (unpinned and freed
  // on another thread: Note [Pinned chunks go back off the caller's thread]).
  // Chunks a steady run uses are taken from every call and stay, so a
  // repeated pattern reaches its steady state without churn; a free chunk
  // has no copy in flight (a device holds its block until its copy ends).
  int64_t release_idle_chunks(int passes) {
    std::vector<std::unique_ptr<HostArenaChunk>> idle;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& chunk : chunks) {
        if (chunk->taken || !chunk->entirely_free()) {
          chunk->taken = false;
          chunk->idle_passes = 0;
        } else if (++chunk->idle_passes >= passes) {
          stats.reserved_bytes -= chunk->size;
          if (chunk->pinned) stats.pinned_bytes -= chunk->size;
          stats.chunks -= 1;
          idle.push_back(std::move(chunk));
        }
      }
      std::erase(chunks, nullptr);
    }
    int64_t released = 0;
    for (const auto& chunk : idle) released += chunk->size;
    if (!idle.empty()) {
      ROUNDPIPE_TRACE("host arena: %zu idle chunk(s), %.2f GiB, go back on the releaser's thread",
                      idle.size(), static_cast<double>(released) / (1 << 30));
      releaser.post(std::move(idle));
    }
    return released;
  }

  const HostArenaOptions options;
  mutable std::mutex mu;
  std::vector<std::unique_ptr<HostArenaChunk>> chunks;
  HostArenaStats stats;
  // Note [Pinned chunks go back off the caller's thread]. Declared last:
  // destroyed first, it frees what it has queued before the state goes.
  ChunkReleaser releaser;
};

HostArena::HostArena(HostArenaOptions options) : options_(options) {
  TORCH_CHECK(options_.alignment > 0 && (options_.alignment & (options_.alignment - 1)) == 0,
              "HostArena: alignment must be a positive power of two, got ", options_.alignment);
  TORCH_CHECK(options_.chunk_bytes > 0, "HostArena: chunk_bytes must be positive, got ",
              options_.chunk_bytes);
  state_ = std::make_shared<State>(options_);
}

HostArena::~HostArena() = default;

void HostArena::reserve(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "HostArena::reserve: bytes must be >= 0, got ", bytes);
  const int64_t size = state_->round_up(bytes);
  if (size == 0) return;
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->add_chunk(size);
}

c10::DataPtr HostArena::allocate(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "HostArena::allocate: bytes must be >= 0, got ", bytes);
  return state_->allocate(state_, bytes);
}

at::Tensor HostArena::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto meta = c10::scalarTypeToTypeMeta(dtype);
  int64_t bytes = static_cast<int64_t>(meta.itemsize());
  for (int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "HostArena::empty: negative dimension ", s, " in sizes ", sizes);
    TORCH_CHECK(!__builtin_mul_overflow(bytes, s, &bytes), "HostArena::empty: sizes ", sizes,
                " of ", dtype, " overflow the byte count");
  }
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, allocate(bytes),
                       /*allocator=*/nullptr, /*resizable=*/false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), meta);
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

int64_t HostArena::block_bytes(int64_t bytes) const {
  return state_->round_up(bytes);
}

int64_t HostArena::release_idle_chunks(int passes) {
  TORCH_CHECK(passes >= 1, "HostArena::release_idle_chunks: passes must be >= 1, got ", passes);
  return state_->release_idle_chunks(passes);
}

HostArenaStats HostArena::stats() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->stats;
}

}  // namespace roundpipe

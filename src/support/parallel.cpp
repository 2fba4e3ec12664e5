#include "support/parallel.h"

#include <ATen/Parallel.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace roundpipe {

namespace {
// Set on a pool's worker threads: a run() from inside a task runs inline
// (waiting for the pool from one of its own threads would never end).
thread_local bool on_a_pool_thread = false;
}  // namespace

struct ThreadPool::State {
  explicit State(int threads, bool low_priority) {
    for (int t = 0; t < threads; ++t) {
      workers_.emplace_back([this, low_priority] {
        on_a_pool_thread = true;
        if (low_priority) lower_priority();
        loop();
      });
    }
  }
  ~State() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    for (auto& w : workers_) w.join();
  }

  void run(int64_t count, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> serial(run_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      count_ = count;
      next_ = 0;
      active_ = static_cast<int>(workers_.size());
      error_ = nullptr;
      ++generation_;
      cv_.notify_all();
    }
    // The caller only waits: the work runs on the pool's threads (at the
    // lower priority, for the optimizer's pool).
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  void work() {
    for (;;) {
      const int64_t i = next_.fetch_add(1);
      if (i >= count_) return;
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
        next_ = count_;  // stop handing out work
      }
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_cv_.notify_all();
    }
  }

  // The optimizer's threads run at a lower scheduling priority (nice +10):
  // they take every core the engine leaves idle, but a worker thread that
  // wakes to enqueue kernels gets its core at once. With the optimizer on
  // every core at normal priority, the kernel launches queued behind it and
  // two H200s ran 2-3% below their one-GPU rate per microbatch.
  static void lower_priority() {
    const auto tid = static_cast<id_t>(syscall(SYS_gettid));
    errno = 0;
    const int now = getpriority(PRIO_PROCESS, tid);
    if (errno == 0) (void)setpriority(PRIO_PROCESS, tid, std::min(now + 10, 19));
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  std::atomic<int64_t> next_{0};
  int64_t count_ = 0;
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

ThreadPool::ThreadPool(int threads, bool low_priority)
    : state_(std::make_unique<State>(std::max(1, threads), low_priority)) {}
ThreadPool::~ThreadPool() = default;
void ThreadPool::run(int64_t count, const std::function<void(int64_t)>& fn) {
  if (count <= 0) return;
  if (count == 1 || on_a_pool_thread) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  state_->run(count, fn);
}

namespace {
// Leaked on purpose: a static's destructor runs at exit, while threads of
// engines that a program left alive (Python leaves those dropped during
// interpreter finalization to the operating system) may still use the
// pool; its idle workers end with the process.
ThreadPool& pool() {
  static auto* instance = new ThreadPool(parallel_threads(), /*low_priority=*/true);
  return *instance;
}
}  // namespace

int parallel_threads() {
  if (const char* env = std::getenv("ROUNDPIPE_CPU_THREADS")) return std::max(1, std::atoi(env));
  return std::max(1, at::get_num_threads());
}

void parallel_for_each(int64_t count, const std::function<void(int64_t)>& fn) {
  pool().run(count, fn);
}

void MemcpyPieces::add(void* dst, const void* src, int64_t bytes) {
  auto* to = static_cast<char*>(dst);
  const auto* from = static_cast<const char*>(src);
  for (int64_t done = 0; done < bytes; done += piece_bytes)
    pieces.push_back({to + done, from + done, std::min(piece_bytes, bytes - done)});
}

void MemcpyPieces::run(ThreadPool* on) const {
  (on ? *on : pool()).run(static_cast<int64_t>(pieces.size()), [&](int64_t i) {
    std::memcpy(pieces[i].dst, pieces[i].src, static_cast<size_t>(pieces[i].bytes));
  });
}

}  // namespace roundpipe

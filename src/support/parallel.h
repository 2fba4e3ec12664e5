// A persistent CPU thread pool for the optimizer's loops and the host work
// of a model's size (quantizing a base, a new model's init). (ATen's
// at::parallel_for is inlined from headers and, in code built without
// OpenMP, runs on one thread: so RoundPipe keeps its own pool.)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace roundpipe {

// Persistent threads that run fn(i) for i in [0, count) (dynamic
// scheduling: each thread takes the next index). run() returns when all are
// done and rethrows the first exception; calls from several threads are
// serialised, and a call from a task of any pool runs inline. `low_priority`: the threads run at
// nice +10 (the optimizer's, so that a worker waking to launch kernels gets its core at once).
class ThreadPool {
 public:
  ThreadPool(int threads, bool low_priority);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  void run(int64_t count, const std::function<void(int64_t)>& fn);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Runs fn(i) for i in [0, count) on the optimizer's ThreadPool
// (parallel_threads() threads at low priority).
void parallel_for_each(int64_t count, const std::function<void(int64_t)>& fn);

// Threads in the pool: $ROUNDPIPE_CPU_THREADS, else at::get_num_threads().
int parallel_threads();

// Large host copies split into pieces that threads copy in parallel.
struct MemcpyPieces {
  struct Piece {
    char* dst;
    const char* src;
    int64_t bytes;
  };
  explicit MemcpyPieces(int64_t piece_bytes) : piece_bytes(piece_bytes) {}
  // Adds the copy of `bytes` from `src` to `dst`, in pieces.
  void add(void* dst, const void* src, int64_t bytes);
  // Copies every piece on `pool` (the optimizer's when null).
  void run(ThreadPool* pool = nullptr) const;

  int64_t piece_bytes;
  std::vector<Piece> pieces;
};

}  // namespace roundpipe

// A persistent CPU thread pool for the optimizer's loops. (ATen's
// at::parallel_for is inlined from headers and, in code built without
// OpenMP, runs on one thread: so RoundPipe keeps its own pool.)
#pragma once

#include <cstdint>
#include <functional>

namespace roundpipe {

// Runs fn(i) for i in [0, count) on the pool's threads (dynamic scheduling:
// each thread takes the next index). Returns when all are done; rethrows the
// first exception. Calls from several threads are serialised.
void parallel_for_each(int64_t count, const std::function<void(int64_t)>& fn);

// Threads in the pool: $ROUNDPIPE_CPU_THREADS, else at::get_num_threads().
int parallel_threads();

}  // namespace roundpipe

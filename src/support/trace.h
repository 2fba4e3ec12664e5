// ROUNDPIPE_TRACE=1: host-side events on stderr, stamped with wall-clock
// milliseconds (the profiler's clock, modulo 100 s) so that they line up
// with a kernel timeline. Internal header.
#pragma once

#include <chrono>

namespace roundpipe::detail {

// Who: the thread's role ("gpu0", "optimizer", ...).
extern thread_local const char* trace_who;
bool tracing();
__attribute__((format(printf, 1, 2))) void trace_print(const char* format, ...);
// Its arguments (job descriptions, timings) are only computed when tracing.
#define ROUNDPIPE_TRACE(...)                                                           \
  do {                                                                                 \
    if (::roundpipe::detail::tracing()) ::roundpipe::detail::trace_print(__VA_ARGS__); \
  } while (0)
// Milliseconds since `start`.
double ms_since(std::chrono::steady_clock::time_point start);

}  // namespace roundpipe::detail

// roundpipe-bench's view of the host memory the process holds: /proc's
// resident set, split by kind, and what glibc's heap keeps for reuse.
// Included by train_bench.cpp only.
#pragma once

#include <malloc.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace roundpipe_bench {

// A line of /proc/self/status ("VmRSS", "VmHWM") in GiB; 0 if absent.
inline double status_gib(const std::string& key) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) / 1048576.0;
  return 0;
}

// The resident set by kind, to tell the model's and the arena's memory from
// the rest of the process: anonymous pages (heap, tensors from malloc, and
// on CUDA the pinned arena, which the driver maps as anonymous or shared
// memory), file pages (the libraries: LibTorch, cuBLAS, the kernels loaded)
// and shared memory; and, of the heap, how much glibc holds free for reuse
// (freed memory that `top` counts until it is trimmed: once RoundPipe's
// weight table returns it, Note [Freed heap memory goes back], the free
// bytes stay in this count but no longer in the resident set).
inline std::string resident_by_kind() {
  const struct mallinfo2 heap = mallinfo2();
  char line[256];
  std::snprintf(line, sizeof line,
                "anonymous %.2f, files %.2f, shared %.2f GiB; heap %.2f GiB in use, %.2f free "
                "held, %.2f mapped apart",
                status_gib("RssAnon"), status_gib("RssFile"), status_gib("RssShmem"),
                heap.uordblks / 1073741824.0, heap.fordblks / 1073741824.0,
                heap.hblkhd / 1073741824.0);
  return line;
}

}  // namespace roundpipe_bench

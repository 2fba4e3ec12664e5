// The optimizer's thread pool (support/parallel.h): every index runs once,
// and a run() from inside a task runs inline instead of waiting for the
// pool from one of its own threads (which would never end).
#include "support/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace roundpipe::testing {
namespace {

TEST(ThreadPool, EveryIndexRunsOnceAndARunFromATaskRunsInline) {
  constexpr int64_t kOuter = 16, kInner = 1000;
  std::vector<std::atomic<int>> runs(kOuter * kInner);
  parallel_for_each(kOuter, [&](int64_t outer) {
    parallel_for_each(kInner, [&](int64_t inner) { ++runs[outer * kInner + inner]; });
  });
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
}

}  // namespace
}  // namespace roundpipe::testing

// The tests' main: GoogleTest's, with LibTorch's CPU kernels on a fixed
// number of threads. A simulated device charges what CPU kernels allocate
// on its worker threads, and some allocate scratch for each thread (CPU flash
// attention: a slice a thread), so a budget tuned on one machine would
// mean less on a machine of more cores (at 64 threads a row-chunk test's
// 1.5 MB device ran out of memory on that scratch alone). Two threads is
// the CI machine's count; every test then charges alike on any machine.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(2);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

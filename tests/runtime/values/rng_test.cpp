// The random-number protocol (runtime/values/rng.h): a microbatch's stream
// is reproduced from a captured state on any device, the caller's generator
// comes back untouched, and microbatch seeds are distinct.
#include "runtime/values/rng.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <set>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

using detail::RngScope;
using detail::RngState;

at::Tensor draw(Device& device) {
  return at::rand({8}, at::TensorOptions().device(device.torch_device()));
}

TEST(Rng, AStreamResumesFromItsCapturedStateOnAnotherDevice) {
  auto devices = make_devices("sim:2");
  RngState start;
  start.active = true;
  start.seed = microbatch_seed(42, 0);
  at::Tensor first, second, resumed;
  RngState middle;
  {
    RngScope scope(*devices[0], start);
    first = draw(*devices[0]);
    middle = scope.capture();
    second = draw(*devices[0]);
  }
  {
    RngScope scope(*devices[1], middle);  // a hand-off to the next device
    resumed = draw(*devices[1]);
  }
  EXPECT_TRUE(at::equal(resumed, second)) << "the stream did not continue where it was";
  EXPECT_FALSE(at::equal(first, second));
  {
    RngScope scope(*devices[1], start);  // a recompute from the start
    EXPECT_TRUE(at::equal(draw(*devices[1]), first));
  }
}

TEST(Rng, TheCallersGeneratorIsRestoredAndInactiveStatesLeaveItAlone) {
  auto devices = make_devices("sim:1");
  auto& device = *devices[0];
  at::manual_seed(7);
  const auto expected = draw(device);
  at::manual_seed(7);
  {
    RngState start;
    start.active = true;
    start.seed = 99;
    RngScope scope(device, start);
    draw(device);
  }
  EXPECT_TRUE(at::equal(draw(device), expected)) << "the scope left the generator moved";
  at::manual_seed(7);
  {
    RngScope scope(device, RngState{});  // preserve_rng_state off
    EXPECT_TRUE(at::equal(draw(device), expected)) << "an inactive state reseeded";
  }
}

TEST(Rng, MicrobatchSeedsAreDistinctAndNonNegative) {
  std::set<uint64_t> seeds;
  for (uint64_t call : {0ull, 1ull, 0x7FFFFFFFFFFFFFFFull})
    for (int m = 0; m < 64; ++m) {
      const uint64_t s = microbatch_seed(call, m);
      EXPECT_LT(s, uint64_t{1} << 63);
      seeds.insert(s);
    }
  EXPECT_EQ(seeds.size(), 3u * 64);
}

}  // namespace
}  // namespace roundpipe::testing

// Note [Device memory budget]: what a CUDA process may hold, from the
// device's readings (a pure function, so tested without a GPU).
#include "device/memory_budget.h"

#include <gtest/gtest.h>

namespace roundpipe {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// A 141 GiB card capped to stand in for a 24, 16 or 12 GiB one, with a
// 0.5 GiB context: the cap less 1.5 GiB (the 22.5 / 14.5 / 10.5).
TEST(MemoryBudget, ACapLeavesRoomForTheContextOfARealCard) {
  for (int64_t cap : {24, 16, 12}) {
    const DeviceMemoryReading r{141 * kGiB, 140 * kGiB + kGiB / 2, 0, cap * kGiB};
    EXPECT_EQ(usable_device_bytes(r), cap * kGiB - kCappedHeadroomBytes) << cap;
  }
}

// What the allocator already reserved stays ours: the same budget.
TEST(MemoryBudget, WhatTheAllocatorReservedIsStillOurs) {
  const DeviceMemoryReading idle{141 * kGiB, 140 * kGiB + kGiB / 2, 0, 24 * kGiB};
  const DeviceMemoryReading busy{141 * kGiB, 130 * kGiB + kGiB / 2, 10 * kGiB, 24 * kGiB};
  EXPECT_EQ(usable_device_bytes(idle), usable_device_bytes(busy));
}

// Another program holds 120 GiB of the card (another data-parallel rank,
// say): the cap still applies where it is lower than what is left; where
// what is left is lower, that, less the margin.
TEST(MemoryBudget, OtherProgramsLeaveWhatIsLeft) {
  EXPECT_EQ(usable_device_bytes({141 * kGiB, 20 * kGiB, 0, 12 * kGiB}),
            12 * kGiB - kCappedHeadroomBytes);
  EXPECT_EQ(usable_device_bytes({141 * kGiB, 8 * kGiB, 2 * kGiB, 20 * kGiB}),
            10 * kGiB - kUncappedMarginBytes);
}

// No cap (a real 24 GiB card whose context and display hold 1 GiB): what is
// free and reserved, less the margin for what loads later.
TEST(MemoryBudget, WithoutACapTheContextIsAlreadyOutside) {
  const DeviceMemoryReading r{24 * kGiB, 21 * kGiB, 2 * kGiB, 0};
  EXPECT_EQ(usable_device_bytes(r), 23 * kGiB - kUncappedMarginBytes);
}

// The allocator's limit under a cap: its measured overshoot (up to one
// 20 MiB large-block rounding past its fraction) still ends within the
// budget of a 24, 16 or 12 GiB card, and little more is given up.
TEST(MemoryBudget, TheAllocatorsOvershootStaysWithinTheBudget) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  for (int64_t cap : {24, 16, 12}) {
    const int64_t budget = usable_device_bytes({141 * kGiB, 140 * kGiB, 0, cap * kGiB});
    const int64_t limit = allocator_limit_bytes(budget);
    EXPECT_LE(limit + 20 * kMiB, budget) << cap;
    EXPECT_GE(limit, budget - 32 * kMiB) << cap;
  }
  EXPECT_EQ(allocator_limit_bytes(0), 1);  // a positive fraction: 0 would allow nothing either
}

TEST(MemoryBudget, NeverNegative) {
  EXPECT_EQ(usable_device_bytes({24 * kGiB, 0, 0, 0}), 0);
  EXPECT_EQ(usable_device_bytes({141 * kGiB, 140 * kGiB, 0, kGiB}), 0);
}

}  // namespace
}  // namespace roundpipe

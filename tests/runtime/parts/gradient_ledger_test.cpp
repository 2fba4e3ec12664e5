// Gradient sums (runtime/gradient_ledger.h): a parameter is final once
// every expected delivery is in; a replicated tail's parts join the sum in
// replica order whatever order the devices finished in; waits for final
// gradients return them, or nothing once cancelled.
#include "runtime/parts/gradient_ledger.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace roundpipe::testing {
namespace {

using namespace std::chrono_literals;

bool never() {
  return false;
}

TEST(GradientLedger, ReplicaPartsAreSummedInReplicaOrder) {
  // float addition is not associative: with parts 1e8, -1e8 and 1 in
  // replica order the sum is (1e8 - 1e8) + 1 = 1, while the arrival orders
  // below give 0 ((1 - 1e8) + 1e8 = 0 in float32: 1 - 1e8 rounds to -1e8).
  const std::vector<float> parts = {1e8f, -1e8f, 1.0f};
  auto expected = at::full({1}, parts[0]);
  for (size_t r = 1; r < parts.size(); ++r) expected = expected + parts[r];
  ASSERT_EQ(expected.item<float>(), 1.0f);
  for (const std::vector<int> arrival : {std::vector<int>{0, 1, 2}, {2, 1, 0}, {1, 2, 0}}) {
    detail::GradientLedger ledger;
    detail::CallGradients call;
    const int id = 7;
    for (size_t r = 0; r < parts.size(); ++r) ledger.expect(call, {id});  // one job per replica
    for (int r : arrival) {
      ledger.add(call, id, r, at::full({1}, parts[r]));
      ledger.delivered(call, {id});
    }
    const auto sums = ledger.take(call);
    ASSERT_EQ(sums.count(id), 1u);
    EXPECT_TRUE(at::equal(sums.at(id), expected))
        << "arrival " << arrival[0] << arrival[1] << arrival[2] << ": "
        << sums.at(id).item<float>();
  }
}

TEST(GradientLedger, AParameterIsFinalOnceEveryDeliveryIsIn) {
  detail::GradientLedger ledger;
  detail::CallGradients first, second;
  ledger.expect(first, {0, 1});
  ledger.expect(first, {1});  // parameter 1 is used by two stages
  ledger.expect(second, {0});
  std::vector<detail::CallGradients*> calls = {&first, &second};
  std::vector<int> ready;
  std::thread waiter([&] { ready = ledger.wait_final(calls, {0, 1}, never); });
  ledger.add(first, 1, -1, at::ones({2}));
  ledger.delivered(first, {0, 1});  // parameter 0 still pending in `second`, 1 in `first`
  std::this_thread::sleep_for(20ms);
  EXPECT_TRUE(ready.empty());
  ledger.add(first, 1, -1, at::ones({2}));
  ledger.delivered(first, {1});
  waiter.join();
  EXPECT_EQ(ready, std::vector<int>{1});
  EXPECT_TRUE(at::equal(ledger.take_sum(calls, 1), at::full({2}, 2.0f)));
  EXPECT_FALSE(ledger.take_sum(calls, 0).defined());  // delivered with no gradient
  EXPECT_TRUE(first.sums.empty());                    // taken: the calls keep none of it
  EXPECT_FALSE(ledger.take_sum(calls, 1).defined());
}

TEST(GradientLedger, ACancelledWaitReturnsNothing) {
  detail::GradientLedger ledger;
  detail::CallGradients call;
  ledger.expect(call, {3});
  std::atomic<bool> cancelled{false};
  std::atomic<int> returned{-1};
  std::thread waiter([&] {
    returned =
        static_cast<int>(ledger.wait_final({&call}, {3}, [&] { return cancelled.load(); }).size());
  });
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(returned.load(), -1);
  cancelled = true;
  ledger.wake();
  waiter.join();
  EXPECT_EQ(returned.load(), 0);
}

}  // namespace
}  // namespace roundpipe::testing

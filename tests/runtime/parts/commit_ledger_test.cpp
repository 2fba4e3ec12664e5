// The buffer-commit order (runtime/commit_ledger.h): a call waits for the
// commits of earlier calls on its layers only, in call order; a cancelled
// wait returns; a failed commit stops later readers with an error.
#include "runtime/parts/commit_ledger.h"

#include <c10/util/Exception.h>
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

TEST(CommitLedger, ACallWaitsOnlyForEarlierCallsOnItsLayers) {
  detail::CommitLedger ledger;
  ledger.expect({1, 2}, /*call=*/0);
  ledger.expect({2}, 1);
  ledger.expect({1, 2}, 2);
  // Call 0 waits for nobody; call 3 on layer 3 neither (no commit there).
  EXPECT_TRUE(ledger.wait_for_earlier({1, 2}, 0, never, "t"));
  EXPECT_TRUE(ledger.wait_for_earlier({3}, 3, never, "t"));
  // Call 2 on layer 2 waits for calls 0 and 1; it proceeds once both settled.
  std::atomic<bool> done{false};
  std::thread reader([&] {
    EXPECT_TRUE(ledger.wait_for_earlier({2}, 2, never, "t"));
    done = true;
  });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(done.load());
  ledger.settle({1, 2}, 0);
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(done.load()) << "call 1's commit of layer 2 is still pending";
  ledger.settle({2}, 1);
  reader.join();
  EXPECT_TRUE(done.load());
  // A call's own pending commit never blocks it.
  EXPECT_TRUE(ledger.wait_for_earlier({1, 2}, 2, never, "t"));
}

TEST(CommitLedger, ACancelledWaitReturnsFalseOnceWoken) {
  detail::CommitLedger ledger;
  ledger.expect({0}, 0);
  std::atomic<bool> cancelled{false};
  std::atomic<int> result{-1};
  std::thread reader([&] {
    result = ledger.wait_for_earlier(
        {0}, 1, [&] { return cancelled.load(); }, "t");
  });
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(result.load(), -1);
  cancelled = true;
  ledger.wake();  // what a failing call's waker does
  reader.join();
  EXPECT_EQ(result.load(), 0);
}

TEST(CommitLedger, AFailedCommitStopsLaterReaders) {
  detail::CommitLedger ledger;
  ledger.expect({4}, 0);
  ledger.settle({4}, 0, /*ok=*/false);
  EXPECT_TRUE(ledger.failed());
  try {
    ledger.wait_for_earlier({4}, 1, never, "pipe");
    FAIL() << "a reader of half-written buffers went on";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("pipe: an earlier call's buffer commit failed"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace roundpipe::testing

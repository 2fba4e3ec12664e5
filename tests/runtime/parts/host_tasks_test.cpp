// The host-task queue (runtime/host_tasks.h): tasks run in order on one
// thread marked as its owner's, drain() waits for all of them, and a
// failure is reported once while later tasks still run.
#include "runtime/parts/host_tasks.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

namespace roundpipe::testing {
namespace {

TEST(HostTasks, RunInOrderOnTheOwnersThreadAndDrainWaitsForAll) {
  const int owner = 0;
  detail::HostTasks tasks(&owner);
  std::vector<int> order;  // written by the task thread only; read after drain()
  std::atomic<int> on_owner{0};
  for (int i = 0; i < 100; ++i) {
    tasks.post(nullptr, [&, i] {
      if (i % 10 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      order.push_back(i);
      on_owner += detail::on_engine_thread(&owner) && detail::on_any_engine_thread();
    });
  }
  tasks.drain();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  EXPECT_EQ(on_owner.load(), 100);
  EXPECT_FALSE(detail::on_engine_thread(&owner));  // the test's own thread is not
  EXPECT_FALSE(detail::on_any_engine_thread());
}

TEST(HostTasks, AFailureIsReportedOnceAndLaterTasksStillRun) {
  const int owner = 0;
  detail::HostTasks tasks(&owner);
  std::atomic<int> ran{0};
  tasks.post(nullptr, [] { throw std::runtime_error("first"); });
  tasks.post(nullptr, [] { throw std::runtime_error("second"); });
  tasks.post(nullptr, [&] { ++ran; });
  try {
    tasks.drain();
    FAIL() << "the failure was lost";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_EQ(ran.load(), 1);
  EXPECT_NO_THROW(tasks.drain());  // reported once
  EXPECT_NO_THROW(tasks.rethrow_failure());
  // rethrow_failure() reports a failure that already happened, without
  // waiting for the queue.
  std::atomic<bool> after{false};
  tasks.post(nullptr, [] { throw std::runtime_error("third"); });
  tasks.post(nullptr, [&] { after = true; });
  while (!after) std::this_thread::yield();
  EXPECT_THROW(tasks.rethrow_failure(), std::runtime_error);
  EXPECT_NO_THROW(tasks.drain());
}

}  // namespace
}  // namespace roundpipe::testing

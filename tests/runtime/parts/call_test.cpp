// One call's shared state (runtime/parts/call.h), checked without devices:
// its buffer snapshot behind methods, its hand-off slots and its
// cancellation (Note [Call cancellation]).
#include "runtime/parts/call.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <thread>

namespace roundpipe::testing {
namespace {

using detail::CallState;

TEST(CallState, ABufferSnapshotIsRestoredIntoTheHomesAndAMissingOneNamed) {
  CallState call;
  call.id = 7;
  auto running_mean = at::zeros({3});
  call.snapshot_buffers(2, {running_mean.clone()});
  running_mean.fill_(5);  // the forward's write
  EXPECT_TRUE(at::equal(call.buffer_snapshot(2)[0], at::zeros({3})));
  call.restore_buffer_snapshots([&](int layer) {
    EXPECT_EQ(layer, 2);
    return std::vector<at::Tensor>{running_mean};
  });
  EXPECT_TRUE(at::equal(running_mean, at::zeros({3})));
  try {
    call.buffer_snapshot(4);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("call 7"), std::string::npos) << what;
    EXPECT_NE(what.find("layer 4"), std::string::npos) << what;
  }
}

TEST(CallState, AFailureWakesAWaiterAndKeepsTheFirstError) {
  CallState call;
  auto slot = call.new_slot();
  std::thread waiter([&] { EXPECT_THROW(call.wait(slot), detail::CallAborted); });
  call.fail(StageError("first", "forward stage 0 (layers 0..1)", 1, 0, "forward", "sim:0", false));
  call.fail(StageError("second", "forward stage 1 (layers 2..3)", 2, 0, "forward", "sim:1", false));
  waiter.join();
  EXPECT_TRUE(call.aborted);
  try {
    call.rethrow_if_failed();
    FAIL() << "no error";
  } catch (const StageError& e) {
    EXPECT_STREQ(e.what(), "first");
    EXPECT_EQ(e.layer, 1);
  }
}

TEST(CallState, APackedInputsMicrobatchesHaveTheirOwnGradientLeaves) {
  CallState call;
  call.input_requires_grad = {true, false, false, true, true};
  EXPECT_EQ(call.microbatch_input_requires_grad(0), call.input_requires_grad);
  call.packed_input_offsets = {0, 2, 5};
  EXPECT_EQ(call.microbatch_input_requires_grad(0), (std::vector<bool>{true, false}));
  EXPECT_EQ(call.microbatch_input_requires_grad(1), (std::vector<bool>{false, true, true}));
}

}  // namespace
}  // namespace roundpipe::testing

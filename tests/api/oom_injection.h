// Out-of-memory errors injected where a test says, as a card raises them
// (c10::OutOfMemoryError), for the recovery tests of tests/api.
#pragma once

#include <c10/util/Exception.h>

#include <atomic>

namespace roundpipe::testing {

// Where a test's module raises the error: the next `injected_ooms` times it
// runs where `inject_when` says, take_injected_oom() is true.
enum class InjectWhen {
  kForward,   // any forward (a forward stage's, first)
  kWithGrad,  // a forward with grad: the fused tail's or a backward stage's
  kBackward,  // its backward (after the loss has gone back)
};
inline std::atomic<int> injected_ooms{0};
inline std::atomic<InjectWhen> inject_when{InjectWhen::kForward};
inline bool take_injected_oom() {
  if (injected_ooms.fetch_sub(1) > 0) return true;
  injected_ooms = 0;
  return false;
}
inline void throw_injected_oom() {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "injected: the device ran out of memory");
}

}  // namespace roundpipe::testing

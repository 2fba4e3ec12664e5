// The order of buffer commits across overlapping calls. A forward-side job
// (forward stage or fused tail) of call c that runs layers with buffers
// registers a pending commit for each at dispatch; a later call's forward
// of such a layer uploads that layer's buffers only once every earlier
// call's commit of it has landed (or was abandoned). Internal header.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <vector>

namespace roundpipe::detail {

class CommitLedger {
 public:
  // Call `call_id` will commit the buffers of `layers`.
  void expect(const std::vector<int>& layers, int64_t call_id);
  // Its commit of `layers` landed, or will never come (its call failed);
  // `ok` = false also marks the buffers as possibly half written.
  void settle(const std::vector<int>& layers, int64_t call_id, bool ok = true);
  // Waits until no call before `call_id` has a commit of `layers` pending.
  // Returns false when `cancelled()` turned true first (a waker must then
  // call wake()). Throws when an earlier commit failed.
  bool wait_for_earlier(const std::vector<int>& layers, int64_t call_id,
                        const std::function<bool()>& cancelled, const std::string& name);
  // Wakes the waits so that they look at their cancellation again
  // (Note [Call cancellation] in call.h).
  void wake();
  bool failed() const { return failed_; }

  // What commits have shown, for replicated tail stages (whose commits
  // would race): whether some commit changed a buffer, and whether every
  // commit of some training call has landed (before that, no forward has
  // shown whether it writes).
  void note_buffer_write() { written_ = true; }
  bool buffers_written() const { return written_; }
  void note_training_call_committed() { committed_ = true; }
  bool training_call_committed() const { return committed_; }

 private:
  bool earlier_pending(const std::vector<int>& layers, int64_t call_id) const;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, std::multiset<int64_t>> pending_;  // per layer: calls whose commit is to come
  std::atomic<bool> failed_{false};
  std::atomic<bool> written_{false};
  std::atomic<bool> committed_{false};
};

}  // namespace roundpipe::detail

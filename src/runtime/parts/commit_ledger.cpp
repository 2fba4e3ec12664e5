#include "runtime/parts/commit_ledger.h"

#include <c10/util/Exception.h>

namespace roundpipe::detail {

void CommitLedger::expect(const std::vector<int>& layers, int64_t call_id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int l : layers) pending_[l].insert(call_id);
}

void CommitLedger::settle(const std::vector<int>& layers, int64_t call_id, bool ok) {
  if (!ok) failed_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int l : layers) {
      auto& pending = pending_[l];
      const auto it = pending.find(call_id);
      if (it != pending.end()) pending.erase(it);
    }
  }
  cv_.notify_all();
}

bool CommitLedger::earlier_pending(const std::vector<int>& layers, int64_t call_id) const {
  for (int l : layers) {
    const auto it = pending_.find(l);
    if (it != pending_.end() && !it->second.empty() && *it->second.begin() < call_id) return true;
  }
  return false;
}

bool CommitLedger::wait_for_earlier(const std::vector<int>& layers, int64_t call_id,
                                    const std::function<bool()>& cancelled,
                                    const std::string& name) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !earlier_pending(layers, call_id) || cancelled(); });
  if (earlier_pending(layers, call_id)) return false;
  TORCH_CHECK(!failed_, name,
              ": an earlier call's buffer commit failed (its error is reported by "
              "synchronize() or the next call), so the layers' buffers may be half written. "
              "Restore them from a checkpoint.");
  return true;
}

void CommitLedger::wake() {
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

}  // namespace roundpipe::detail

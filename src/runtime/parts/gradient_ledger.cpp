#include "runtime/parts/gradient_ledger.h"

#include <algorithm>

namespace roundpipe::detail {

void GradientLedger::expect(CallGradients& call, const std::vector<int>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int id : ids) ++call.pending[id];
}

void GradientLedger::add(CallGradients& call, int id, int replica, const at::Tensor& grad) {
  at::Tensor* acc;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // (map nodes stay put while other threads insert)
    acc = replica < 0 ? &call.sums[id] : &call.replica_parts[id][replica];
  }
  *acc = acc->defined() ? acc->add_(grad) : grad;
}

void GradientLedger::delivered(CallGradients& call, const std::vector<int>& ids) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int id : ids) {
      auto it = call.pending.find(id);
      if (it == call.pending.end() || it->second == 0) continue;
      if (it->second == 1) {
        auto parts = call.replica_parts.find(id);
        if (parts != call.replica_parts.end()) {
          at::Tensor sum;
          for (auto& [replica, g] : parts->second) sum = sum.defined() ? sum.add_(g) : g;
          auto& acc = call.sums[id];
          acc = acc.defined() ? acc.add_(sum) : sum;
          call.replica_parts.erase(parts);
        }
      }
      --it->second;
    }
  }
  cv_.notify_all();
}

std::vector<int> GradientLedger::wait_final(const std::vector<CallGradients*>& calls,
                                            const std::set<int>& candidates,
                                            const std::function<bool()>& cancelled) {
  std::vector<int> ready;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    if (cancelled()) return true;
    for (int id : candidates) {
      const bool final = std::all_of(calls.begin(), calls.end(), [&](const CallGradients* call) {
        const auto it = call->pending.find(id);
        return it == call->pending.end() || it->second == 0;
      });
      if (final) ready.push_back(id);
    }
    return !ready.empty();
  });
  if (cancelled()) ready.clear();
  return ready;
}

at::Tensor GradientLedger::take_sum(const std::vector<CallGradients*>& calls, int id) {
  at::Tensor total;
  for (auto* call : calls) {
    at::Tensor g;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = call->sums.find(id);
      if (it != call->sums.end()) {
        g = std::move(it->second);
        call->sums.erase(it);
      }
    }
    if (g.defined()) total = total.defined() ? total.add_(g) : g;
  }
  return total;
}

std::map<int, at::Tensor> GradientLedger::take(CallGradients& call) {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(call.sums, {});
}

void GradientLedger::wake() {
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

}  // namespace roundpipe::detail

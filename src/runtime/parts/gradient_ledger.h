// Parameter gradients as the backward stages of calls deliver them: per
// call and parameter, the sum so far and how many stages are still to
// deliver; a replicated tail's parts, added in replica order (not in the
// order the devices finished) before the parameter counts as final. The
// optimizer waits here for final gradients. Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <vector>

namespace roundpipe::detail {

// One call's gradients; its structure is guarded by the ledger.
struct CallGradients {
  std::map<int, at::Tensor> sums;                          // per parameter id
  std::map<int, int> pending;                              // per parameter: deliveries to come
  std::map<int, std::map<int, at::Tensor>> replica_parts;  // per parameter, per replica
};

class GradientLedger {
 public:
  // A backward-side job of the call will deliver gradients of `ids`.
  void expect(CallGradients& call, const std::vector<int>& ids);
  // Adds a downloaded gradient of parameter `id` to the call's sum, or
  // (replica >= 0) to that replica's part. Adds come from one thread (the
  // gradient tasks'), and the add itself runs outside the lock.
  void add(CallGradients& call, int id, int replica, const at::Tensor& grad);
  // A job's deliveries of `ids` are in (also for ids it had no gradient
  // for); a parameter whose last delivery this is gets its replica parts
  // added to its sum, in replica order, and becomes final.
  void delivered(CallGradients& call, const std::vector<int>& ids);
  // Waits until some of `candidates` are final in every call, or until
  // cancelled() (checked whenever woken: wake()). Returns the final ones;
  // none when cancelled.
  std::vector<int> wait_final(const std::vector<CallGradients*>& calls,
                              const std::set<int>& candidates,
                              const std::function<bool()>& cancelled);
  // Parameter `id`'s gradient summed over `calls` in their order
  // (undefined when none has one), taken out of them: the calls keep no
  // part of it, so its memory goes as soon as the caller drops the sum
  // (a step frees each gradient once it is applied, not at its end).
  at::Tensor take_sum(const std::vector<CallGradients*>& calls, int id);
  // Takes the call's sums (the call keeps none).
  std::map<int, at::Tensor> take(CallGradients& call);
  // Wakes the waits so that they look at their cancellation again
  // (Note [Call cancellation] in call.h).
  void wake();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace roundpipe::detail

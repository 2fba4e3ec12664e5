// The optimizer thread: each step() takes the gradients of the calls since
// the last one and updates the masters (a user step function, or the fused
// Adam pass writing the low-precision weights too), then publishes the new
// weight version (Note [Weight versions]): at once for a synchronous step,
// at the next step or synchronize() for an asynchronous one, whose calls
// run one update behind meanwhile. src/optim holds the math; this holds
// when it runs and what it reads and writes. Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "roundpipe/data_parallel_options.h"
#include "roundpipe/optim/adam.h"
#include "roundpipe/optim/grad_clip.h"
#include "roundpipe/optim/grad_scaler.h"
#include "runtime/parallel/gradient_averager.h"
#include "runtime/parts/call.h"
#include "runtime/parts/gradient_ledger.h"
#include "runtime/parts/host_tasks.h"
#include "runtime/parts/stats_recorder.h"
#include "runtime/parts/weight_table.h"

namespace roundpipe::detail {

// How a step's update reaches the weights.
enum class StepKind {
  kSync,            // the step function updates the masters, copied into the homes; waited for
  kSyncFused,       // the fused pass writes the homes in place; waited for
  kAsync,           // masters; the next step (or synchronize) publishes them
  kAsyncFused,      // the fused pass writes staging copies, swapped in by the next step
  kAsyncPiecewise,  // kAsyncFused parameter by parameter as gradients become final
};

class OptimizerStream {
 public:
  // `owner`: the engine (its threads' marks). `data_parallel`: the
  // gradients are averaged over its processes first (Note [Data parallel
  // steps]).
  OptimizerStream(const void* owner, WeightTable& weights, GradientLedger& grads,
                  StatsRecorder& stats, std::optional<c10::ScalarType> optim_dtype,
                  const DataParallelOptions* data_parallel);

  // The weight version a call started now reads: the latest update's, or
  // with an async step pending the one before.
  int64_t version_for_new_calls() const { return version_for_new_calls_; }
  // Rethrows an earlier step's failure and makes the masters if missing:
  // call before taking the calls a step consumes, and before step().
  void prepare_step();
  // Queues one update with the gradients of `calls`: the user's step
  // function on the masters' .grad, or the fused Adam pass.
  void step(std::vector<std::shared_ptr<CallState>> calls, std::function<void()> step_fn,
            bool is_async);
  void step_fused(std::vector<std::shared_ptr<CallState>> calls, optim::Adam& adam, bool is_async,
                  optim::GradScaler* scaler, optim::GradClipper* clip);
  // The fused pass by `update`, once every gradient of the step is final.
  void step_fused(std::vector<std::shared_ptr<CallState>> calls, optim::FusedUpdate update,
                  bool is_async);

  // The masters (made on first use, from the homes once no step is queued).
  std::vector<std::pair<std::string, at::Tensor>> named_masters();
  // Waits for `calls` and sums their parameter gradients; throws the first
  // call's error (a failed call contributes nothing).
  std::map<int, at::Tensor> take_gradients(std::vector<std::shared_ptr<CallState>> calls);

  // Waits for every queued step; rethrows the first failure.
  void drain() { thread_.drain(); }
  // Rethrows (once) a failure of a step that already ran.
  void rethrow_failure() { thread_.rethrow_failure(); }
  // Whether an async update waits to be published (call after drain()).
  bool update_pending() const { return pending_publish_ >= 0; }
  // Publishes the pending async update (after drain()); new calls read it.
  void publish_pending();
  // Makes the masters one update ahead of the homes (a checkpoint of an
  // async run restored; after synchronize()): the next step publishes them.
  void restore_pending_update();

 private:
  using Update = std::function<void(std::map<int, at::Tensor>&)>;
  void ensure_masters();
  // A fused pass's tensors: the masters with a gradient in `grads`, their
  // low-precision gradients, and where the pass writes each new weight
  // (async: the staging copy, since the next calls still read the current
  // weights and publishing swaps it in; sync: the home, as no call runs).
  struct FusedTensors {
    std::vector<at::Tensor> masters, grads, outs;
  };
  FusedTensors fused_tensors(const std::map<int, at::Tensor>& grads, bool is_async);
  // A tensor shaped as master `id` for its gradient in a step function,
  // on the memory of its last one where nothing uses that any more (Note
  // [Gradient buffers kept across steps]). On the optimizer thread.
  at::Tensor grad_buffer(int id, const at::Tensor& master);
  void queue(std::vector<std::shared_ptr<CallState>> calls, Update update, StepKind kind);
  // The update of one step, on the optimizer thread.
  void run_whole(std::vector<std::shared_ptr<CallState>> calls, const Update& update, StepKind kind,
                 int64_t version);
  void run_piecewise(std::vector<std::shared_ptr<CallState>> calls, const Update& update,
                     int64_t version);
  // Runs `update` on batches of the calls' summed gradients, each as soon as
  // every backward stage producing them has delivered (deepest layers
  // first, while shallower stages still run), publishing `pending_version`
  // (if >= 0) for each parameter just before; then waits for the calls and
  // rethrows the first one's error. Data parallel: the batches are the
  // averager's buckets, averaged over the processes.
  // Sharded (Note [Sharded optimizer state]): `send` (when given) has the
  // owners send each bucket's new weights as soon as its update ran.
  struct Sending {
    StepKind kind;
    int64_t version;  // the version the new weights make
  };
  void update_as_gradients_arrive(std::vector<std::shared_ptr<CallState>> calls,
                                  int64_t pending_version, const Update& update,
                                  const Sending* send = nullptr);
  // Data parallel: waits for each bucket's gradients in turn, starts its
  // average, and runs `update` on the averages of the buckets before
  // (Note [Data parallel steps]). Returns early when a call failed.
  void update_averaged_buckets(
      const std::vector<CallGradients*>& call_grads, const std::function<bool()>& failed,
      const std::function<std::map<int, at::Tensor>(const std::vector<int>&)>& take_final,
      const Update& update, const Sending* send);
  // Sharded: starts sending bucket `index`'s new weights (the owner's
  // `updated` ids; the others pass none), then finishes the oldest sent;
  // the others write them where a step of `send.kind` writes its weights.
  void start_sending(int index, const std::vector<int>& updated, const Sending& send);
  void finish_sending(const Sending& send);
  // Sharded: after a whole update, every bucket's new weights (the owner's
  // ids in `updated`) to the others.
  void send_all(const std::set<int>& updated, const Sending& send);
  // The global norm of `grads` (sharded: of every process's share).
  double gradient_norm(const std::vector<at::Tensor>& grads);

  WeightTable& weights_;
  GradientLedger& grads_;
  StatsRecorder& stats_;
  std::optional<c10::ScalarType> optim_dtype_;
  std::unique_ptr<GradientAverager> averager_;  // data parallel, else none
  int64_t updates_ = 0;                         // step() calls so far
  int64_t version_for_new_calls_ = 0;           // weights a new call reads
  int64_t pending_publish_ = -1;                // async: masters hold this version, homes not yet
  std::map<int, c10::Storage> grad_memory_;     // Note [Gradient buffers kept across steps]
  // Last: destroyed (its thread joined) before the members its tasks use.
  HostTasks thread_;
};

}  // namespace roundpipe::detail

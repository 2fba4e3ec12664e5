// Data parallel: averages a step's parameter gradients over the processes
// of a c10d group, bucket by bucket. Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <map>
#include <vector>

#include "roundpipe/data_parallel_options.h"

namespace c10d {
class Work;
}

namespace roundpipe::detail {

// Note [Data parallel steps]
// Every process runs its own RoundPipe on its share of the batch; a step
// averages the gradients of the processes' calls, then each process runs
// the same update on the same averaged gradients, so the weights stay the
// same everywhere without ever being sent. The gradients travel in buckets
// of a fixed composition: the trainable parameters in the order backward
// finishes them (deepest first), cut at DataParallelOptions::bucket_bytes.
// Collectives must be issued in the same order on every process, and a
// bucket's parameters become final in a different order on each, so the
// optimizer thread waits for a bucket's parameters, starts its all-reduce
// (asynchronous: Gloo's threads do the work) and goes on waiting for the
// next bucket while it travels: the reduction overlaps the rest of the
// backward, and only the last bucket's is left once backward is done.
// A bucket carries one count per parameter besides the values: whether the
// process had a gradient for it. A parameter no process had a gradient for
// stays without one (the optimizer skips it, as it would in one process);
// one that only some had gets the mean with zeros for the others.
// Note [Sharded optimizer state]
// With DataParallelOptions::shard_optimizer_state each trainable parameter
// has one owner: the buckets, in their fixed order, are cut into N
// contiguous runs of about equal bytes, and every bucket lies in one run
// (a bucket is cut where the owner changes). Only the owner keeps the
// parameter's master and Adam moments. A bucket's gradients are reduced to
// its owner alone (c10d reduce: the mean arrives there, the others drop
// their sums); the owner updates it and broadcasts the new weights, in the
// model's dtype, with one flag per parameter: whether it changed (a
// parameter no process had a gradient for keeps its weight everywhere).
// The others write what arrives where the step would have written it (the
// staging copy of an async step, the home of a sync one). Per step each
// process sends about the gradients' bytes once and the weights' once, as
// an all-reduce would send the gradients twice; its host keeps 1/N of the
// masters and moments. What needs every gradient (the clipping norm) adds
// its per-process parts over the group.
class GradientAverager {
 public:
  explicit GradientAverager(const DataParallelOptions& options);
  ~GradientAverager();

  int world_size() const { return world_size_; }
  bool sharded() const { return options_.shard_optimizer_state; }
  // Fixes the buckets and their owners (once): `ids` in the order backward
  // makes their gradients final, `like(id)` a tensor of the gradient's
  // shape and dtype (the model's weight).
  void plan(const std::vector<int>& ids, const std::function<at::Tensor(int)>& like);
  bool planned() const { return !buckets_.empty(); }
  const std::vector<std::vector<int>>& buckets() const { return buckets_; }
  // The rank that keeps the optimizer state of bucket `index` (sharded);
  // every rank unsharded.
  int owner(int index) const { return owners_.at(index); }
  bool owns(int id) const;

  // Refuses to train processes whose weights differ (built from different
  // seeds or checkpoints, where averaging gradients would train nothing
  // meaningful): compares a fingerprint of each `weight(id)` over the
  // processes, once (later calls return at once).
  void check_same_weights(const std::function<at::Tensor(int)>& weight,
                          const std::function<std::string(int)>& name);

  // Starts averaging bucket `index` of `grads` (this process's sums, ids of
  // other buckets ignored; absent ids: no gradient here).
  void start(int index, const std::map<int, at::Tensor>& grads);
  // Waits for the oldest started bucket and returns its averaged gradients
  // (the ids some process had a gradient for; sharded: none on the
  // processes that do not own it).
  std::map<int, at::Tensor> finish_oldest();
  int in_flight() const { return static_cast<int>(pending_.size()); }
  int oldest() const { return pending_.front().index; }
  // Forgets the started buckets (a call failed: this step has no update).
  void abandon();

  // Sharded: sends bucket `index`'s new weights from its owner, which
  // passes `updated` (id -> tensor holding the new weight, the model's
  // dtype; ids absent did not change). The others pass nothing.
  void start_weights(int index, const std::map<int, at::Tensor>& updated);
  // Waits for the oldest weights sent; on the others, copies each changed
  // weight into `target(id)`. Returns the ids that changed.
  std::vector<int> finish_oldest_weights(const std::function<at::Tensor(int)>& target);
  int weights_in_flight() const { return static_cast<int>(sending_.size()); }
  // The sum of `value` over the processes (on the optimizer thread, in
  // step order like the buckets).
  double sum(double value, const char* what);

 private:
  struct Pending {
    int index;
    at::Tensor flat;              // the values, then one count per parameter
    std::vector<at::Tensor> own;  // this process's sums (undefined: none), overwritten by the means
    c10::intrusive_ptr<c10d::Work> work;
  };
  // The gradient-shaped tensors of bucket `index`'s parameters, in order.
  std::vector<at::Tensor> likes_of(int index) const;
  // A failed collective as an error naming what it did and the likely cause.
  [[noreturn]] void fail(const std::string& doing, const std::exception& e) const;

  DataParallelOptions options_;
  int world_size_;
  int rank_;
  std::vector<std::vector<int>> buckets_;
  std::vector<int64_t> bucket_values_;  // per bucket: its gradients' elements
  std::vector<int64_t> bucket_bytes_;   // per bucket: its weights' bytes
  std::vector<int> owners_;             // per bucket
  std::map<int, int> bucket_of_;        // per id
  std::map<int, at::Tensor> like_;      // per id: shape and dtype of its gradient
  std::deque<Pending> pending_;
  std::deque<Pending> sending_;  // sharded: new weights on their way (flags, then bytes)
  int64_t reductions_ = 0;       // buckets started so far (for messages)
  bool weights_checked_ = false;
};

}  // namespace roundpipe::detail

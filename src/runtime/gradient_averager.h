// Data parallel: averages a step's parameter gradients over the processes
// of a c10d group, bucket by bucket. Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <map>
#include <vector>

#include "roundpipe/distributed.h"

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
class GradientAverager {
 public:
  explicit GradientAverager(const DataParallelOptions& options);
  ~GradientAverager();

  int world_size() const { return world_size_; }
  // Fixes the buckets (once): `ids` in the order backward makes their
  // gradients final, `like(id)` a tensor of the gradient's shape and dtype.
  void plan(const std::vector<int>& ids, const std::function<at::Tensor(int)>& like);
  bool planned() const { return !buckets_.empty(); }
  const std::vector<std::vector<int>>& buckets() const { return buckets_; }

  // Refuses to train processes whose weights differ (built from different
  // seeds or checkpoints, where averaging gradients would train nothing
  // meaningful): compares a fingerprint of each `weight(id)` over the
  // processes, once, at the first step.
  void check_same_weights(const std::function<at::Tensor(int)>& weight,
                          const std::function<std::string(int)>& name);

  // Starts averaging bucket `index` of `grads` (this process's sums, ids of
  // other buckets ignored; absent ids: no gradient here).
  void start(int index, const std::map<int, at::Tensor>& grads);
  // Waits for the oldest started bucket and returns its averaged gradients
  // (the ids some process had a gradient for).
  std::map<int, at::Tensor> finish_oldest();
  int in_flight() const { return static_cast<int>(pending_.size()); }
  // Forgets the started buckets (a call failed: this step has no update).
  void abandon();

 private:
  struct Pending {
    int index;
    at::Tensor flat;              // the values, then one count per parameter
    std::vector<at::Tensor> own;  // this process's sums (undefined: none), overwritten by the means
    c10::intrusive_ptr<c10d::Work> work;
  };
  DataParallelOptions options_;
  int world_size_;
  int rank_;
  std::vector<std::vector<int>> buckets_;
  std::map<int, at::Tensor> like_;  // per id: shape and dtype of its gradient
  std::deque<Pending> pending_;
  int64_t reductions_ = 0;  // buckets started so far (for messages)
};

}  // namespace roundpipe::detail

// A training run's data, step by step: which examples a step trains on (a
// shuffle by seed, one per epoch), how they are batched (packed into rows
// or padded), and which share a data-parallel process takes. roundpipe-train
// and the Python roundpipe.train both draw their steps from here, so one
// seed gives one trajectory in either (Note [One training stack] in
// docs/architecture.md).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "roundpipe/train/data.h"

namespace roundpipe::train {

struct StepDataOptions {
  int64_t batch_size = 8;  // examples a call, over all processes
  int64_t grad_accum = 1;  // calls a step
  int64_t seq_len = 2048;  // tokens a packed row at most
  bool packing = true;     // else one example a row, right padded
  int64_t min_rows = 1;    // packed rows a call at least: one per microbatch
  uint64_t seed = 0;
  int processes = 1;  // data parallel: each takes batch_size / processes examples a call
  int rank = 0;

  StepDataOptions& set_batch_size(int64_t v) {
    batch_size = v;
    return *this;
  }
  StepDataOptions& set_grad_accum(int64_t v) {
    grad_accum = v;
    return *this;
  }
  StepDataOptions& set_seq_len(int64_t v) {
    seq_len = v;
    return *this;
  }
  StepDataOptions& set_packing(bool v) {
    packing = v;
    return *this;
  }
  StepDataOptions& set_min_rows(int64_t v) {
    min_rows = v;
    return *this;
  }
  StepDataOptions& set_seed(uint64_t v) {
    seed = v;
    return *this;
  }
  StepDataOptions& set_process(int rank_, int processes_) {
    rank = rank_;
    processes = processes_;
    return *this;
  }
};

// One step's calls for this process, with the step's counts over all
// processes (the loss is the mean over the step's labelled tokens).
struct StepBatches {
  std::vector<Batch> batches;  // grad_accum calls
  int64_t tokens = 0;          // non-pad tokens of the step, all processes
  int64_t loss_tokens = 0;     // labels the step's loss counts, all processes
};

class StepData {
 public:
  // Checks the options against the data (throws naming the fix).
  StepData(std::shared_ptr<const Dataset> data, StepDataOptions options);

  // Steps in an epoch (the free function's, for this data).
  int64_t steps_per_epoch() const;
  // The batches of `step` (0-based): epoch step / steps_per_epoch shuffles
  // the examples with std::mt19937_64(seed + epoch); step k of the epoch
  // takes the next batch_size * grad_accum of them, call by call, each
  // call's examples in processes consecutive shares. Only those examples
  // are read (a token file's pages).
  StepBatches at(int64_t step);

  const Dataset& data() const { return *data_; }
  const StepDataOptions& options() const { return options_; }

 private:
  std::shared_ptr<const Dataset> data_;
  StepDataOptions options_;
  int64_t order_epoch_ = -1;  // the epoch whose shuffle `order_` holds
  std::vector<int64_t> order_;
};

// Steps in an epoch: the whole steps of batch_size * grad_accum examples
// that num_examples fill (at least 1).
int64_t steps_per_epoch(int64_t num_examples, int64_t batch_size, int64_t grad_accum);

// `count` indices in the order std::shuffle with std::mt19937_64(seed)
// leaves them.
std::vector<int64_t> shuffled_indices(int64_t count, uint64_t seed);

// The data split for evaluation: the last round(fraction * size) examples
// (at least 1) of a shuffle by seed + 7919 are held out; the training
// examples keep their file order. Throws when that holds out everything.
struct HeldOutSplit {
  std::shared_ptr<Dataset> train, eval;
};
HeldOutSplit hold_out(std::shared_ptr<const Dataset> all, double fraction, uint64_t seed);

}  // namespace roundpipe::train

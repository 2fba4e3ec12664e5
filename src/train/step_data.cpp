// A training run's steps: see include/roundpipe/train/step_data.h.
#include "roundpipe/train/step_data.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace roundpipe::train {

std::vector<int64_t> shuffled_indices(int64_t count, uint64_t seed) {
  std::vector<int64_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  return order;
}

HeldOutSplit hold_out(std::shared_ptr<const Dataset> all, double fraction, uint64_t seed) {
  TORCH_CHECK(std::isfinite(fraction) && fraction > 0 && fraction < 1,
              "the held-out fraction must be in (0, 1), got ", fraction);
  auto order = shuffled_indices(all->size(), seed + 7919);
  const auto count =
      std::max<int64_t>(1, std::llround(fraction * static_cast<double>(all->size())));
  TORCH_CHECK(count < all->size(), "an evaluation fraction of ", fraction, " holds out all ",
              all->size(), " examples: give a smaller fraction");
  HeldOutSplit split;
  split.eval = subset(all, {order.end() - count, order.end()});
  order.resize(order.size() - count);
  std::sort(order.begin(), order.end());
  split.train = subset(std::move(all), std::move(order));
  return split;
}

StepData::StepData(std::shared_ptr<const Dataset> data, StepDataOptions options)
    : data_(std::move(data)), options_(options) {
  const auto& o = options_;
  TORCH_CHECK(data_ && data_->size() > 0, "the training data holds no examples");
  TORCH_CHECK(o.batch_size >= 1 && o.grad_accum >= 1 && o.seq_len >= 1,
              "batch size, gradient accumulation and sequence length must be at least 1, got ",
              o.batch_size, ", ", o.grad_accum, " and ", o.seq_len);
  TORCH_CHECK(o.processes >= 1 && o.rank >= 0 && o.rank < o.processes, "process ", o.rank, " of ",
              o.processes, " is not one of them");
  TORCH_CHECK(o.batch_size % o.processes == 0, "a batch of ", o.batch_size,
              " examples does not split over ", o.processes,
              " processes: make the batch size a multiple of ", o.processes);
  TORCH_CHECK(o.batch_size * o.grad_accum <= data_->size(), "a step of ", o.batch_size, " x ",
              o.grad_accum, " examples needs more than the ", data_->size(),
              " the data holds: lower the batch size or the gradient accumulation");
  TORCH_CHECK(o.min_rows >= 1, "min_rows must be at least 1, got ", o.min_rows);
}

int64_t steps_per_epoch(int64_t num_examples, int64_t batch_size, int64_t grad_accum) {
  return std::max<int64_t>(1, num_examples / (batch_size * grad_accum));
}

int64_t StepData::steps_per_epoch() const {
  return train::steps_per_epoch(data_->size(), options_.batch_size, options_.grad_accum);
}

StepBatches StepData::at(int64_t step) {
  TORCH_CHECK(step >= 0, "step ", step, " is negative");
  const auto& o = options_;
  const int64_t epoch = step / steps_per_epoch();
  if (epoch != order_epoch_) {
    order_ = shuffled_indices(data_->size(), o.seed + static_cast<uint64_t>(epoch));
    order_epoch_ = epoch;
  }
  const int64_t first = (step % steps_per_epoch()) * o.batch_size * o.grad_accum;
  const int64_t share = o.batch_size / o.processes;
  std::vector<int64_t> in_order(o.batch_size);
  std::iota(in_order.begin(), in_order.end(), 0);
  StepBatches out;
  for (int64_t call = 0; call < o.grad_accum; ++call) {
    const auto examples = gather(*data_, order_, first + call * o.batch_size, o.batch_size);
    // Every share is batched, to count the step's tokens over all processes.
    for (int rank = 0; rank < o.processes; ++rank) {
      auto batch = o.packing ? pack(examples, in_order, rank * share, share, o.seq_len,
                                    std::min(o.min_rows, share))
                             : collate(examples, in_order, rank * share, share);
      out.tokens += batch.tokens;
      out.loss_tokens += batch.loss_tokens;
      if (rank == o.rank) out.batches.push_back(std::move(batch));
    }
  }
  return out;
}

}  // namespace roundpipe::train

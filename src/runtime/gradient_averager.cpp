// Averaging a step's gradients over processes: see gradient_averager.h.
#include "runtime/gradient_averager.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "roundpipe/errors.h"

namespace roundpipe::detail {

GradientAverager::GradientAverager(const DataParallelOptions& options)
    : options_(options), world_size_(options.world_size()), rank_(options.rank()) {
  TORCH_CHECK(options.bucket_bytes > 0, "DataParallelOptions::bucket_bytes must be > 0, got ",
              options.bucket_bytes);
  TORCH_CHECK(at::isFloatingType(options.reduce_dtype),
              "DataParallelOptions::reduce_dtype must be a floating-point dtype, got ",
              options.reduce_dtype);
}

GradientAverager::~GradientAverager() = default;

void GradientAverager::abandon() {
  pending_.clear();
}

void GradientAverager::plan(const std::vector<int>& ids,
                            const std::function<at::Tensor(int)>& like) {
  TORCH_CHECK(buckets_.empty(), "internal: the gradient buckets are planned once");
  const int64_t element = c10::elementSize(options_.reduce_dtype);
  int64_t bytes = 0;
  for (int id : ids) {
    like_[id] = like(id);
    const int64_t size = like_[id].numel() * element;
    if (buckets_.empty() || (bytes > 0 && bytes + size > options_.bucket_bytes)) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().push_back(id);
    bytes += size;
  }
}

void GradientAverager::check_same_weights(const std::function<at::Tensor(int)>& weight,
                                          const std::function<std::string(int)>& name) {
  std::vector<int> ids;
  for (const auto& bucket : buckets_) ids.insert(ids.end(), bucket.begin(), bucket.end());
  const auto count = static_cast<int64_t>(ids.size());
  // Integer sums of the bits (as 16-bit words): exact, so the same on
  // every process whatever its thread count adds in which order.
  auto fingerprint = at::empty({2 * count}, at::kLong);
  for (int64_t i = 0; i < count; ++i) {
    const auto words = weight(ids[i]).contiguous().view(at::kShort).to(at::kLong);
    fingerprint[2 * i].fill_(words.sum());
    fingerprint[2 * i + 1].fill_(words.square().sum());
  }
  // The largest and (negated) the smallest over the processes.
  std::vector<at::Tensor> high{fingerprint.clone()}, low{fingerprint.neg()};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  try {
    options_.process_group->allreduce(high, max)->wait();
    options_.process_group->allreduce(low, max)->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "data parallel: comparing the starting weights of the ", world_size_,
                " processes failed on rank ", rank_, ": ", error_message(e),
                ". Another process most likely stopped (its output says why)");
  }
  const auto differs = (high[0] + low[0]).ne(0);
  const auto* flags = differs.const_data_ptr<bool>();
  int first = -1;  // in forward order
  for (int64_t i = 0; i < 2 * count; ++i) {
    if (flags[i] && (first < 0 || ids[i / 2] < first)) first = ids[i / 2];
  }
  if (first >= 0) {
    TORCH_CHECK(false, "data parallel: the ", world_size_,
                " processes start from different weights (", name(first), " differs first; rank ",
                rank_,
                "): build the model from the same checkpoint, or seed every process alike "
                "before building it");
  }
}

void GradientAverager::start(int index, const std::map<int, at::Tensor>& grads) {
  const auto& ids = buckets_.at(index);
  int64_t values = 0;
  for (int id : ids) values += like_.at(id).numel();
  auto flat = at::empty({values + static_cast<int64_t>(ids.size())},
                        at::TensorOptions().dtype(options_.reduce_dtype));
  std::vector<at::Tensor> own(ids.size());
  int64_t offset = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t numel = like_.at(ids[i]).numel();
    auto slice = flat.narrow(0, offset, numel);
    const auto found = grads.find(ids[i]);
    const bool has = found != grads.end() && found->second.defined();
    if (has) {
      own[i] = found->second;
      slice.copy_(own[i].reshape({-1}));
    } else {
      slice.zero_();
    }
    flat[values + static_cast<int64_t>(i)].fill_(has ? 1 : 0);
    offset += numel;
  }
  std::vector<at::Tensor> tensors{flat};
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = options_.process_group->allreduce(tensors);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "data parallel: cannot start averaging gradient bucket ", index + 1, " of ",
                buckets_.size(), " over ", world_size_, " processes (this is rank ", rank_,
                "): ", error_message(e));
  }
  pending_.push_back(Pending{index, flat, std::move(own), work});
  ++reductions_;
}

std::map<int, at::Tensor> GradientAverager::finish_oldest() {
  TORCH_CHECK(!pending_.empty(), "internal: no gradient bucket is being averaged");
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  try {
    p.work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "data parallel: averaging gradient bucket ", p.index + 1, " of ",
                buckets_.size(), " over ", world_size_, " processes failed on rank ", rank_,
                " (bucket ", reductions_ - static_cast<int64_t>(pending_.size()),
                " since the start): ", error_message(e),
                ". Another process most likely stopped (its output says why), or it did not "
                "reach this step within the group's timeout; every process must run the same "
                "number of steps");
  }
  const auto& ids = buckets_.at(p.index);
  int64_t values = 0;
  for (int id : ids) values += like_.at(id).numel();
  // Counts are exact small integers, in any float dtype used here.
  const auto counts = p.flat.narrow(0, values, static_cast<int64_t>(ids.size())).to(at::kFloat);
  const auto* count = counts.const_data_ptr<float>();
  p.flat.narrow(0, 0, values).div_(world_size_);
  std::map<int, at::Tensor> averaged;
  int64_t offset = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& like = like_.at(ids[i]);
    const int64_t numel = like.numel();
    const auto mean = p.flat.narrow(0, offset, numel).view(like.sizes());
    if (p.own[i].defined()) {
      averaged[ids[i]] = p.own[i].copy_(mean);  // in place: no new gradient-sized tensor
    } else if (count[i] > 0) {
      averaged[ids[i]] = mean.to(like.scalar_type(), false, /*copy=*/true);
    }
    offset += numel;
  }
  return averaged;
}

}  // namespace roundpipe::detail

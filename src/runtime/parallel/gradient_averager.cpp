// Averaging a step's gradients over processes: see gradient_averager.h.
#include "runtime/parallel/gradient_averager.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

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
  sending_.clear();
}

namespace {
// Byte offsets of the weights in a bucket's message are multiples of this
// (views of the bytes as any dtype are then aligned).
constexpr int64_t kWeightAlign = 8;
int64_t aligned(int64_t bytes) {
  return (bytes + kWeightAlign - 1) / kWeightAlign * kWeightAlign;
}
// The weights in a bucket's message `flat` (the flags, then each weight's
// bytes, aligned), each viewed in its dtype and shape (`likes`).
std::vector<at::Tensor> weight_views(const at::Tensor& flat, const std::vector<at::Tensor>& likes) {
  std::vector<at::Tensor> views;
  int64_t offset = aligned(static_cast<int64_t>(likes.size()));
  for (const auto& like : likes) {
    const int64_t bytes = like.numel() * like.element_size();
    views.push_back(flat.narrow(0, offset, bytes).view(like.scalar_type()).view(like.sizes()));
    offset += aligned(bytes);
  }
  return views;
}
}  // namespace

void GradientAverager::plan(const std::vector<int>& ids,
                            const std::function<at::Tensor(int)>& like) {
  TORCH_CHECK(buckets_.empty(), "internal: the gradient buckets are planned once");
  const int64_t element = c10::elementSize(options_.reduce_dtype);
  int64_t total = 0;
  for (int id : ids) {
    like_[id] = like(id);
    total += like_[id].numel();
  }
  // Sharded: the owner of a parameter is the rank its middle element falls
  // to when the elements, in bucket order, are cut into N equal runs.
  int64_t before = 0, bytes = 0;
  for (int id : ids) {
    const int64_t numel = like_[id].numel();
    const int owner = !sharded() ? rank_
                                 : static_cast<int>(std::min<int64_t>(
                                       world_size_ - 1, (2 * before + numel) * world_size_ /
                                                            (2 * std::max<int64_t>(total, 1))));
    before += numel;
    const int64_t size = numel * element;
    if (buckets_.empty() || (bytes > 0 && bytes + size > options_.bucket_bytes) ||
        owner != owners_.back()) {
      buckets_.emplace_back();
      bucket_values_.push_back(0);
      bucket_bytes_.push_back(0);
      owners_.push_back(owner);
      bytes = 0;
    }
    buckets_.back().push_back(id);
    bucket_of_[id] = static_cast<int>(buckets_.size()) - 1;
    bucket_values_.back() += numel;
    bucket_bytes_.back() += aligned(numel * like_[id].element_size());
    bytes += size;
  }
}

std::vector<at::Tensor> GradientAverager::likes_of(int index) const {
  std::vector<at::Tensor> likes;
  for (int id : buckets_.at(index)) likes.push_back(like_.at(id));
  return likes;
}

bool GradientAverager::owns(int id) const {
  return !sharded() || owners_.at(bucket_of_.at(id)) == rank_;
}

void GradientAverager::fail(const std::string& doing, const std::exception& e) const {
  TORCH_CHECK(false, "data parallel: ", doing, " over ", world_size_, " processes failed on rank ",
              rank_, ": ", error_message(e),
              ". Another process most likely stopped (its output says why), or it did not "
              "reach this step within the group's timeout; every process must run the same "
              "number of steps");
}

void GradientAverager::check_same_weights(const std::function<at::Tensor(int)>& weight,
                                          const std::function<std::string(int)>& name) {
  if (weights_checked_) return;
  weights_checked_ = true;
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
    fail("comparing the starting weights", e);
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
  const int64_t values = bucket_values_.at(index);
  auto flat = at::empty({values + static_cast<int64_t>(ids.size())},
                        at::TensorOptions().dtype(options_.reduce_dtype));
  std::vector<at::Tensor> own(ids.size());
  std::vector<float> has(ids.size(), 0.0f);
  int64_t offset = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t numel = like_.at(ids[i]).numel();
    auto slice = flat.narrow(0, offset, numel);
    const auto found = grads.find(ids[i]);
    if (found != grads.end() && found->second.defined()) {
      own[i] = found->second;
      slice.copy_(own[i].reshape({-1}));
      has[i] = 1.0f;
    } else {
      slice.zero_();
    }
    offset += numel;
  }
  flat.narrow(0, values, static_cast<int64_t>(ids.size()))
      .copy_(at::from_blob(has.data(), {static_cast<int64_t>(has.size())}, at::kFloat));
  std::vector<at::Tensor> tensors{flat};
  c10::intrusive_ptr<c10d::Work> work;
  try {
    if (sharded()) {
      c10d::ReduceOptions to_owner;
      to_owner.rootRank = owners_.at(index);
      work = options_.process_group->reduce(tensors, to_owner);
    } else {
      work = options_.process_group->allreduce(tensors);
    }
  } catch (const std::exception& e) {
    fail("starting the reduction of gradient bucket " + std::to_string(index + 1) + " of " +
             std::to_string(buckets_.size()),
         e);
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
    fail("averaging gradient bucket " + std::to_string(p.index + 1) + " of " +
             std::to_string(buckets_.size()) + " (bucket " +
             std::to_string(reductions_ - static_cast<int64_t>(pending_.size())) +
             " since the start)",
         e);
  }
  const auto& ids = buckets_.at(p.index);
  const int64_t values = bucket_values_.at(p.index);
  if (owners_.at(p.index) != rank_) return {};  // sharded: the owner has the mean
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

void GradientAverager::start_weights(int index, const std::map<int, at::Tensor>& updated) {
  const auto& ids = buckets_.at(index);
  const int owner = owners_.at(index);
  const auto count = static_cast<int64_t>(ids.size());
  // One flag per parameter (as bytes), then each weight's bytes, aligned.
  auto flat = at::empty({aligned(count) + bucket_bytes_.at(index)}, at::kByte);
  if (owner == rank_) {
    c10::NoGradGuard no_grad;  // (a step function's masters require grad)
    auto* flags = flat.mutable_data_ptr<uint8_t>();
    const auto views = weight_views(flat, likes_of(index));
    for (int64_t i = 0; i < count; ++i) {
      const auto found = updated.find(ids[i]);
      flags[i] = found != updated.end() ? 1 : 0;
      if (flags[i] != 0) views[i].copy_(found->second);
    }
  }
  std::vector<at::Tensor> tensors{flat};
  c10d::BroadcastOptions from_owner;
  from_owner.rootRank = owner;
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = options_.process_group->broadcast(tensors, from_owner);
  } catch (const std::exception& e) {
    fail("starting to send the new weights of bucket " + std::to_string(index + 1), e);
  }
  sending_.push_back(Pending{index, flat, {}, work});
}

std::vector<int> GradientAverager::finish_oldest_weights(
    const std::function<at::Tensor(int)>& target) {
  TORCH_CHECK(!sending_.empty(), "internal: no weights are being sent");
  Pending p = std::move(sending_.front());
  sending_.pop_front();
  try {
    p.work->wait();
  } catch (const std::exception& e) {
    fail("sending the new weights of bucket " + std::to_string(p.index + 1) + " of " +
             std::to_string(buckets_.size()) + " from rank " + std::to_string(owners_.at(p.index)),
         e);
  }
  const auto& ids = buckets_.at(p.index);
  const auto count = static_cast<int64_t>(ids.size());
  const auto* flags = p.flat.const_data_ptr<uint8_t>();
  const bool mine = owners_.at(p.index) == rank_;
  const auto views = weight_views(p.flat, likes_of(p.index));
  std::vector<int> changed;
  c10::NoGradGuard no_grad;
  for (int64_t i = 0; i < count; ++i) {
    if (flags[i] == 0) continue;
    changed.push_back(ids[i]);
    if (!mine) target(ids[i]).copy_(views[i]);
  }
  return changed;
}

double GradientAverager::sum(double value, const char* what) {
  std::vector<at::Tensor> tensors{at::full({1}, value, at::kDouble)};
  try {
    options_.process_group->allreduce(tensors)->wait();
  } catch (const std::exception& e) {
    fail(std::string("adding up ") + what, e);
  }
  return tensors[0].item<double>();
}

}  // namespace roundpipe::detail

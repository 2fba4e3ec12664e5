// The optimizer thread's steps: see optimizer_stream.h.
#include "runtime/engine/optimizer_stream.h"

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "support/host_cast.h"
#include "support/trace.h"

namespace roundpipe::detail {

namespace {
bool is_async(StepKind kind) {
  return kind != StepKind::kSync && kind != StepKind::kSyncFused;
}
}  // namespace

OptimizerStream::OptimizerStream(const void* owner, WeightTable& weights, GradientLedger& grads,
                                 StatsRecorder& stats, std::optional<c10::ScalarType> optim_dtype,
                                 const DataParallelOptions* data_parallel)
    : weights_(weights),
      grads_(grads),
      stats_(stats),
      optim_dtype_(optim_dtype),
      averager_(data_parallel != nullptr ? std::make_unique<GradientAverager>(*data_parallel)
                                         : nullptr),
      thread_(owner) {}

void OptimizerStream::ensure_masters() {
  if (averager_ && !averager_->planned()) {
    // The buckets, and with sharding who keeps which masters, before any.
    auto ids = weights_.trainable_ids();
    std::reverse(ids.begin(), ids.end());  // backward finishes the deepest layers first
    averager_->plan(ids, [&](int id) { return weights_.home(id); });
  }
  if (!weights_.masters_missing()) return;
  thread_.drain();  // the homes must hold the weights the masters start from
  if (averager_ && averager_->sharded()) {
    weights_.make_masters(optim_dtype_, [&](int id) { return averager_->owns(id); });
  } else {
    weights_.make_masters(optim_dtype_);
  }
}

double OptimizerStream::gradient_norm(const std::vector<at::Tensor>& grads) {
  const double norm = optim::global_grad_norm(grads);
  if (!averager_ || !averager_->sharded()) return norm;
  return std::sqrt(averager_->sum(norm * norm, "the squares of the gradient norm"));
}

void OptimizerStream::start_sending(int index, const std::vector<int>& updated,
                                    const Sending& send) {
  std::map<int, at::Tensor> weights;
  for (int id : updated) {
    switch (send.kind) {
      case StepKind::kSync:
      case StepKind::kAsync:  // the step function updated the master
        weights[id] = weights_.master(id).to(weights_.home(id).scalar_type());
        break;
      case StepKind::kSyncFused:  // the fused pass wrote the home
        weights[id] = weights_.home(id);
        break;
      default:  // the fused pass wrote the staging copy
        weights[id] = weights_.stage(id);
    }
  }
  averager_->start_weights(index, weights);
}

void OptimizerStream::finish_sending(const Sending& send) {
  const bool async = is_async(send.kind);
  const auto changed = averager_->finish_oldest_weights(
      [&](int id) { return async ? weights_.stage(id) : weights_.home(id); });
  if (async) weights_.staged_written(changed, send.version);
}

void OptimizerStream::send_all(const std::set<int>& updated, const Sending& send) {
  const auto& buckets = averager_->buckets();
  for (int b = 0; b < static_cast<int>(buckets.size()); ++b) {
    std::vector<int> mine;
    for (int id : buckets[b]) {
      if (updated.count(id) > 0) mine.push_back(id);
    }
    start_sending(b, mine, send);
    while (averager_->weights_in_flight() > 1) finish_sending(send);
  }
  while (averager_->weights_in_flight() > 0) finish_sending(send);
}

std::vector<std::pair<std::string, at::Tensor>> OptimizerStream::named_masters() {
  ensure_masters();
  return weights_.named_masters();
}

// Note [Gradient buffers kept across steps]
// A step with the caller's function hands it the gradients in the masters'
// .grad, cast to their dtype (the original's semantics). Made afresh each
// step (g.to(float32)), a 3B model's 12.8 GB of float32 gradients came
// from new pages every step: glibc maps allocations that large afresh, and
// the kernel zeroes each page at its first touch, then zero_grad() (None,
// torch's default) unmaps them again. So each master keeps the memory of
// its last .grad and the cast writes into it, when no tensor uses that
// memory any more: a caller who kept last step's p.grad (or a view of it)
// keeps its values, and this step gets new memory. The memory is kept, not
// the tensor: a tensor still referenced here when Python drops its wrapper
// would keep the wrapper alive (PyObject preservation), and with it the
// tensor, so its memory could never be reused. Where a .grad is still there
// (the step function did not zero it), the gradient is added in place, cast
// on the fly where that is exact (into a wider or the same dtype: the same
// sum as adding its cast copy). The memory stays allocated between steps:
// 4 bytes a trainable float32 parameter.
at::Tensor OptimizerStream::grad_buffer(int id, const at::Tensor& master) {
  auto& memory = grad_memory_[id];
  const auto bytes = static_cast<size_t>(master.numel()) * master.element_size();
  if (memory && memory.use_count() == 1 && memory.nbytes() == bytes) {
    return at::empty({0}, master.options()).set_(memory, 0, master.sizes());
  }
  auto fresh = at::empty(master.sizes(), master.options());
  memory = fresh.storage();
  return fresh;
}

void OptimizerStream::step(std::vector<std::shared_ptr<CallState>> calls,
                           std::function<void()> step_fn, bool is_async) {
  queue(
      std::move(calls),
      [this, step_fn = std::move(step_fn)](std::map<int, at::Tensor>& grads) {
        const auto start = std::chrono::steady_clock::now();
        for (auto& [id, g] : grads) {
          auto master = weights_.master(id);
          if (!master.defined()) continue;
          auto& grad = master.mutable_grad();
          if (!grad.defined()) {
            auto buffer = grad_buffer(id, master);
            cast_copy(buffer, g);  // Note [Casts that bypass the cache]
            grad = buffer;
          } else if (c10::promoteTypes(grad.scalar_type(), g.scalar_type()) == grad.scalar_type()) {
            grad.add_(g);
          } else {
            grad.add_(g.to(grad.scalar_type()));
          }
          // In .grad now: the step's low-precision sum goes back before the
          // function runs, for the next call's gradients to take its place.
          g = at::Tensor();
        }
        const double cast_ms = ms_since(start);
        step_fn();
        ROUNDPIPE_TRACE("step function: gradients into .grad in %.1f ms, the function %.1f ms",
                        cast_ms, ms_since(start) - cast_ms);
      },
      is_async ? StepKind::kAsync : StepKind::kSync);
}

void OptimizerStream::step_fused(std::vector<std::shared_ptr<CallState>> calls, optim::Adam& adam,
                                 bool is_async, optim::GradScaler* scaler,
                                 optim::GradClipper* clip) {
  // Parameter by parameter as gradients arrive, unless a scaler or a
  // clipper must first see every gradient (a sync step has nothing to
  // overlap).
  TORCH_CHECK(scaler == nullptr || !averager_ || !averager_->sharded(),
              "step(adam, ..., scaler): a GradScaler with DataParallelOptions::"
              "shard_optimizer_state is not supported (each process would find inf/NaN in its "
              "own share only); train in bfloat16, which needs no scaler, or do not shard");
  const StepKind kind = !is_async                                ? StepKind::kSyncFused
                        : (scaler == nullptr && clip == nullptr) ? StepKind::kAsyncPiecewise
                                                                 : StepKind::kAsyncFused;
  // The learning rate now: the caller may set the next step's before this
  // one has run.
  const double lr = adam.lr();
  queue(
      std::move(calls),
      [this, &adam, is_async, scaler, clip, lr](std::map<int, at::Tensor>& grads) {
        auto t = fused_tensors(grads, is_async);
        // (Clipped after the scaler unscaled them.)
        auto update = [&] {
          const double multiplier = clip != nullptr ? clip->clip_norm(gradient_norm(t.grads)) : 1.0;
          adam.fused_step(t.masters, t.grads, t.outs, lr, multiplier);
        };
        if (scaler == nullptr) {
          update();
        } else if (!scaler->step(t.grads, update)) {
          for (auto& [id, g] : grads) weights_.unstage(id);  // skipped: nothing new to publish
          if (clip != nullptr) clip->skipped();
        }
      },
      kind);
}

void OptimizerStream::step_fused(std::vector<std::shared_ptr<CallState>> calls,
                                 optim::FusedUpdate update, bool is_async) {
  queue(
      std::move(calls),
      [this, update = std::move(update), is_async](std::map<int, at::Tensor>& grads) {
        const auto t = fused_tensors(grads, is_async);
        try {
          update(t.masters, t.grads, t.outs);
        } catch (...) {
          // What the update wrote is not trusted: each master goes out as
          // it is (async: the publish copies it, its staging copy unused).
          for (const auto& [id, g] : grads) {
            if (!weights_.master(id).defined()) continue;
            if (is_async) {
              weights_.unstage(id);
            } else {
              cast_copy(weights_.home(id), weights_.master(id));
            }
          }
          throw;
        }
        if (is_async) return;  // (the publish copies the masters it has no staging copy of)
        // A sync step publishes by version only: a master the caller's
        // update changed without a gradient here (a .grad left from before)
        // goes to its home now.
        for (int id : weights_.ids_with_master()) {
          if (grads.count(id) == 0) cast_copy(weights_.home(id), weights_.master(id));
        }
      },
      is_async ? StepKind::kAsyncFused : StepKind::kSyncFused);
}

OptimizerStream::FusedTensors OptimizerStream::fused_tensors(const std::map<int, at::Tensor>& grads,
                                                             bool is_async) {
  FusedTensors t;
  for (const auto& [id, g] : grads) {
    auto master = weights_.master(id);
    if (!master.defined()) continue;
    t.masters.push_back(master);
    t.grads.push_back(g);
    t.outs.push_back(is_async ? weights_.stage(id) : weights_.home(id));
  }
  return t;
}

void OptimizerStream::prepare_step() {
  thread_.rethrow_failure();
  ensure_masters();
}

void OptimizerStream::queue(std::vector<std::shared_ptr<CallState>> calls, Update update,
                            StepKind kind) {
  const int64_t version = ++updates_;  // the version this update makes
  // Async: the next calls run on the weights of the update before this one
  // (one step of staleness); sync: on this step's result.
  version_for_new_calls_ = is_async(kind) ? version - 1 : version;
  thread_.post(nullptr, [this, calls = std::move(calls), update = std::move(update), kind,
                         version]() mutable {
    trace_who = "optimizer";
    if (kind == StepKind::kAsyncPiecewise) {
      run_piecewise(std::move(calls), update, version);
    } else {
      run_whole(std::move(calls), update, kind, version);
    }
  });
  if (!is_async(kind)) thread_.drain();
}

void OptimizerStream::run_whole(std::vector<std::shared_ptr<CallState>> calls, const Update& update,
                                StepKind kind, int64_t version) {
  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  if (pending_publish_ >= 0) {
    weights_.publish(pending_publish_);  // the previous update, now that its readers are known
    ROUNDPIPE_TRACE("published v%lld (%.1f ms)", static_cast<long long>(pending_publish_),
                    ms_since(start));
    pending_publish_ = -1;
    stats_.add_since(&PipelineStats::optimizer_publish_seconds, start);
  }
  // Calls already wait for this version: publish it even when gathering
  // the gradients (a call that failed in the background) or the update
  // throws (the masters hold whatever it left), then report; else the next
  // call's uploads would wait for it forever.
  std::exception_ptr error;
  start = Clock::now();
  std::map<int, at::Tensor> grads;
  try {
    if (averager_) {
      // Averaged bucket by bucket while backward still runs; the update
      // needs them all (a scaler, a clipper or the user's step function).
      update_as_gradients_arrive(std::move(calls), -1,
                                 [&](std::map<int, at::Tensor>& batch) { grads.merge(batch); });
    } else {
      grads = take_gradients(std::move(calls));
    }
  } catch (...) {
    error = std::current_exception();
  }
  ROUNDPIPE_TRACE("update v%lld: gradients ready after %.1f ms", static_cast<long long>(version),
                  ms_since(start));
  stats_.add_since(&PipelineStats::optimizer_grad_wait_seconds, start);
  start = Clock::now();
  if (!error) {
    try {
      update(grads);
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (averager_ && averager_->sharded() && !error) {
    // The owners' new weights to the others (each updated what it owns).
    // A step function may change any master it has; the fused pass, the
    // ones with a gradient.
    std::set<int> updated;
    if (kind == StepKind::kSync || kind == StepKind::kAsync) {
      const auto owned = weights_.ids_with_master();
      updated.insert(owned.begin(), owned.end());
    } else {
      for (const auto& [id, g] : grads) {
        if (weights_.master(id).defined()) updated.insert(id);
      }
    }
    const Sending send{kind, version};
    try {
      send_all(updated, send);
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (kind == StepKind::kAsyncFused && !error) {
    // The staged weights are written: calls that read this version may
    // upload them from the staging copies before they are published.
    weights_.staged_written(weights_.ids_with_master(), version);
  }
  ROUNDPIPE_TRACE("update v%lld: done in %.1f ms", static_cast<long long>(version),
                  ms_since(start));
  stats_.add_since(&PipelineStats::optimizer_update_seconds, start);
  start = Clock::now();
  if (is_async(kind)) {
    pending_publish_ = version;
  } else if (kind == StepKind::kSyncFused) {
    weights_.publish_version_only(version);  // the fused pass wrote the weights
  } else {
    weights_.publish(version);
  }
  stats_.add_since(&PipelineStats::optimizer_publish_seconds, start);
  stats_.count_update();
  if (error) std::rethrow_exception(error);
}

void OptimizerStream::run_piecewise(std::vector<std::shared_ptr<CallState>> calls,
                                    const Update& update, int64_t version) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Each batch of final gradients is applied while the calls' shallower
  // stages still run, and its staged weights are available at once to
  // calls that read this update's version.
  double updating = 0;
  std::exception_ptr error;
  const Sending send{StepKind::kAsyncPiecewise, version};
  try {
    update_as_gradients_arrive(
        std::move(calls), pending_publish_,
        [&](std::map<int, at::Tensor>& batch) {
          const auto batch_start = Clock::now();
          update(batch);
          std::vector<int> ids;
          for (auto& [id, g] : batch) ids.push_back(id);
          weights_.staged_written(ids, version);
          updating += ms_since(batch_start) / 1000;
        },
        averager_ && averager_->sharded() ? &send : nullptr);
  } catch (...) {
    error = std::current_exception();
    if (pending_publish_ >= 0) weights_.publish(pending_publish_);
  }
  pending_publish_ = version;
  const double total = ms_since(start) / 1000;
  ROUNDPIPE_TRACE("update v%lld: done piecewise (%.1f ms updating in %.1f ms)",
                  static_cast<long long>(version), updating * 1000, total * 1000);
  stats_.add(&PipelineStats::optimizer_update_seconds, updating);
  stats_.add(&PipelineStats::optimizer_grad_wait_seconds, total - updating);
  stats_.count_update();
  if (error) std::rethrow_exception(error);
}

void OptimizerStream::update_as_gradients_arrive(std::vector<std::shared_ptr<CallState>> calls,
                                                 int64_t pending_version, const Update& update,
                                                 const Sending* send) {
  const auto with_master = weights_.ids_with_master();
  std::set<int> left(with_master.begin(), with_master.end());
  std::vector<CallGradients*> call_grads;
  for (const auto& call : calls) call_grads.push_back(&call->grads);
  auto failed = [&] {
    return std::any_of(calls.begin(), calls.end(), [](const auto& c) { return c->aborted.load(); });
  };
  // The final gradients of `ids`, summed over the calls.
  auto take_final = [&](const std::vector<int>& ids) {
    std::map<int, at::Tensor> batch;
    for (int id : ids) {
      left.erase(id);
      at::Tensor sum = grads_.take_sum(call_grads, id);
      // The previous update's weights go live first (once the calls that
      // read the older ones have uploaded them): the update writes over
      // the storage they leave.
      if (pending_version >= 0) weights_.publish_one(id, pending_version);
      if (sum.defined()) batch[id] = sum;
    }
    return batch;
  };
  if (averager_) {
    update_averaged_buckets(call_grads, failed, take_final, update, send);
  } else {
    while (!left.empty()) {
      // A failing call wakes the wait (Note [Call cancellation]); the
      // failure is reported below.
      const auto ready = grads_.wait_final(call_grads, left, failed);
      if (ready.empty()) break;
      auto batch = take_final(ready);
      if (!batch.empty()) update(batch);
    }
  }
  if (pending_version >= 0) weights_.publish(pending_version);  // parameters without gradients
  for (const auto& call : calls) call->work.wait_none();
  // A call that failed: the batches final before it failed were applied
  // (their weights go live with this update); the rest were not. (Unless
  // its error already reached the caller through autograd.)
  for (const auto& call : calls) {
    if (!call->reported) call->rethrow_if_failed();
  }
  for (auto* call : call_grads) grads_.take(*call);
}

void OptimizerStream::update_averaged_buckets(
    const std::vector<CallGradients*>& call_grads, const std::function<bool()>& failed,
    const std::function<std::map<int, at::Tensor>(const std::vector<int>&)>& take_final,
    const Update& update, const Sending* send) {
  // (The homes: every process has them, and the masters start from them.)
  averager_->check_same_weights([&](int id) { return weights_.home(id); },
                                [&](int id) { return weights_.name(id); });
  const auto& buckets = averager_->buckets();
  auto update_oldest = [&] {
    const int index = averager_->oldest();
    auto averaged = averager_->finish_oldest();
    if (!averaged.empty()) update(averaged);
    if (send == nullptr) return;
    std::vector<int> updated;
    for (const auto& [id, g] : averaged) updated.push_back(id);
    start_sending(index, updated, *send);
    // The weights of the bucket before have travelled meanwhile.
    while (averager_->weights_in_flight() > 1) finish_sending(*send);
  };
  try {
    for (int b = 0; b < static_cast<int>(buckets.size()); ++b) {
      std::set<int> waiting(buckets[b].begin(), buckets[b].end());
      while (!waiting.empty()) {
        // A failing call wakes the wait (Note [Call cancellation]); the
        // caller reports the failure. The other processes' reductions then
        // fail too, at their group's timeout at the latest.
        const auto ready = grads_.wait_final(call_grads, waiting, failed);
        if (ready.empty()) {
          averager_->abandon();
          return;
        }
        for (int id : ready) waiting.erase(id);
      }
      averager_->start(b, take_final(buckets[b]));
      // The bucket before has travelled while this one's gradients arrived.
      while (averager_->in_flight() > 1) update_oldest();
    }
    while (averager_->in_flight() > 0) update_oldest();
    while (averager_->weights_in_flight() > 0) finish_sending(*send);
  } catch (...) {
    averager_->abandon();
    throw;
  }
}

std::map<int, at::Tensor> OptimizerStream::take_gradients(
    std::vector<std::shared_ptr<CallState>> calls) {
  std::map<int, at::Tensor> grads;
  for (auto& call : calls) call->work.wait_none();
  // A failed call contributes nothing; its error is thrown here unless the
  // caller already had it.
  std::erase_if(calls, [](const auto& call) { return call->reported.load(); });
  for (auto& call : calls) call->rethrow_if_failed();
  for (auto& call : calls) {
    for (auto& [id, g] : grads_.take(call->grads)) {
      auto& sum = grads[id];
      sum = sum.defined() ? sum.add_(g) : g;
    }
  }
  return grads;
}

void OptimizerStream::publish_pending() {
  if (pending_publish_ < 0) return;
  weights_.publish(pending_publish_);
  version_for_new_calls_ = pending_publish_;
  pending_publish_ = -1;
}

void OptimizerStream::restore_pending_update() {
  // After synchronize() the weights are at version updates_ and nothing is
  // pending: the masters become one update ahead, published by the next
  // step() or synchronize() before anything else (Note [Weight versions]).
  ensure_masters();
  pending_publish_ = ++updates_;
  if (averager_ && averager_->sharded()) {
    // The others' share of that update is in the owners' masters only.
    const auto owned = weights_.ids_with_master();
    send_all(std::set<int>(owned.begin(), owned.end()),
             Sending{StepKind::kAsync, pending_publish_});
  }
}

}  // namespace roundpipe::detail

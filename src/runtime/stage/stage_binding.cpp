// A stage job's binding and transfers: see stage_binding.h.
#include "runtime/stage/stage_binding.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <sstream>
#include <unordered_map>

#include "roundpipe/errors.h"
#include "runtime/memory/allocation_meter.h"
#include "runtime/values/ivalue_tree.h"
#include "runtime/values/transfer.h"
#include "support/trace.h"

namespace roundpipe::detail {

StageBinding::StageBinding(const StageContext& context, Job& job, Device& device,
                           StageProgress& progress)
    : ctx_(context), job_(job), device_(device), call_(*job.call), progress_(progress) {}

StageBinding::~StageBinding() {
  for (auto& [l, instance] : instances_) ctx_.instances.release(l, std::move(instance));
}

void StageBinding::acquire_instances() {
  const auto start = std::chrono::steady_clock::now();
  for (int l = job_.range.begin; l < job_.range.end; ++l)
    instances_[l] = ctx_.instances.acquire(l, device_);
  if (ms_since(start) > 0.5)
    ROUNDPIPE_TRACE("call %lld: layer instances took %.1f ms", static_cast<long long>(call_.id),
                    ms_since(start));
}

void StageBinding::bind() {
  if (bound_) return;
  progress_.phase = "buffer commit of an earlier call";
  if (job_.kind != JobKind::kBackward) wait_for_earlier_commits();
  progress_.phase = "parameter upload";
  std::unordered_map<int, at::Tensor> by_id;
  for (size_t i = 0; i < job_.param_ids.size(); ++i)
    by_id[job_.param_ids[i]] = job_.device_params[i];
  std::vector<at::Tensor> host_buffers;
  std::vector<size_t> counts;
  for (int l = job_.range.begin; l < job_.range.end; ++l) {
    std::vector<at::Tensor> buffers = ctx_.layers[l]->buffers();
    if (job_.kind == JobKind::kBackward && !buffers.empty()) {
      buffers = call_.buffer_snapshot(l);
    } else if (job_.kind == JobKind::kForward && !buffers.empty()) {
      // Taken for every call: a call redone after running out of memory
      // (Note [Out-of-memory redo]) starts from these values.
      HostAllocationScope host;  // the snapshot is host memory
      std::vector<at::Tensor> snapshot;
      for (const auto& b : buffers) snapshot.push_back(b.clone());
      call_.snapshot_buffers(l, std::move(snapshot));
    }
    counts.push_back(buffers.size());
    host_buffers.insert(host_buffers.end(), buffers.begin(), buffers.end());
  }
  // On the activation queue: the parameter queue may already carry the
  // next job's upload, which this job's compute must not wait for.
  auto [device_buffers, buffers_ready] = device_.upload(Queue::kActUpload, host_buffers, nullptr);
  size_t next = 0;
  for (int l = job_.range.begin; l < job_.range.end; ++l) {
    std::vector<at::Tensor> params, buffers;
    std::vector<bool> requires_grad;
    for (int id : ctx_.weights.layer_param_ids(l)) {
      params.push_back(by_id.at(id));
      requires_grad.push_back(job_.kind != JobKind::kForward && ctx_.weights.trainable(id));
    }
    const size_t count = counts[l - job_.range.begin];
    buffers.assign(device_buffers.begin() + next, device_buffers.begin() + next + count);
    next += count;
    instances_[l]->bind(params, requires_grad, buffers, ctx_.layers[l]->is_training());
  }
  device_.wait(Queue::kCompute, job_.params_ready);
  device_.wait(Queue::kCompute, buffers_ready);
  bound_ = true;
}

void StageBinding::wait_for_earlier_commits() {
  const auto start = std::chrono::steady_clock::now();
  // A failing call wakes this wait (Note [Call cancellation]).
  if (!ctx_.commits.wait_for_earlier(
          job_.commit_layers, call_.id, [&] { return call_.aborted.load(); }, ctx_.name)) {
    throw CallAborted{};
  }
  if (ms_since(start) > 0.5)
    ROUNDPIPE_TRACE("call %lld: waited %.1f ms for earlier calls' buffer commits",
                    static_cast<long long>(call_.id), ms_since(start));
}

c10::IValue StageBinding::load_input(Slot& slot) {
  progress_.phase = "activation upload";
  auto [x, event] = upload_value(device_, slot.value, slot.event);
  bind();
  device_.wait(Queue::kCompute, event);
  return x;
}

std::vector<at::Tensor> StageBinding::load_grad(int boundary, int microbatch) {
  Slot& g = call_.wait(call_.grad.at(boundary)[microbatch]);
  progress_.phase = "activation upload";
  auto [grads, event] = upload_flat(device_, Queue::kActUpload, g.tensors, g.event);
  device_.wait(Queue::kCompute, event);
  return grads;
}

void StageBinding::send_input_gradients(int layer, int microbatch,
                                        const std::vector<at::Tensor>& grads) {
  if (layer == 0) {
    // The caller's inputs that require grad (forward() and
    // forward_backward() alike), kept for the engine to send upstream.
    const auto wanted = call_.microbatch_input_requires_grad(microbatch);
    if (!call_.training || std::none_of(wanted.begin(), wanted.end(), [](bool w) { return w; }))
      return;
  }
  progress_.phase = "download";
  auto [host, event] = download_flat(device_, grads, ctx_.weights.host_allocator());
  if (layer > 0) {
    CallState::put(*call_.grad.at(layer)[microbatch], {}, host, event, {});
  } else {
    event->synchronize();
    call_.input_grads[microbatch] = host;
  }
}

c10::IValue StageBinding::download_output(const c10::IValue& output) {
  progress_.phase = "download";
  auto [out, event] = download_value(
      device_,
      map_tensors(output, [](const at::Tensor& t) { return t.defined() ? t.detach() : t; }),
      ctx_.weights.host_allocator());
  output_event_ = event;
  return out;
}

void StageBinding::send_results(int microbatch, const at::Tensor& loss, const c10::IValue& output) {
  progress_.phase = "download";
  auto [host_loss, loss_event] =
      download_flat(device_, {loss.detach().reshape({})}, ctx_.weights.host_allocator());
  auto hand_over = [this, microbatch, host_loss = host_loss, loss_event = loss_event, output,
                    output_event = output_event_] {
    CallState::put(*call_.losses[microbatch], {}, host_loss, loss_event, {});
    if (call_.return_outputs)
      CallState::put(*call_.outputs[microbatch], output, {}, output_event, {});
  };
  if (hold_results_) {
    held_results_.push_back(std::move(hand_over));
  } else {
    hand_over();
  }
}

void StageBinding::release_results() {
  hold_results_ = false;
  for (auto& hand_over : held_results_) hand_over();
  held_results_.clear();
}

std::vector<at::Tensor> StageBinding::clone_buffers(int layer) {
  std::vector<at::Tensor> kept;
  for (const auto& b : instances_.at(layer)->buffer_values()) kept.push_back(b.clone());
  return kept;
}

void StageBinding::restore_buffers(int layer, const std::vector<at::Tensor>& kept) {
  c10::NoGradGuard no_grad;
  auto now = instances_.at(layer)->buffer_values();
  for (size_t i = 0; i < kept.size(); ++i) now[i].copy_(kept[i]);
}

// Sums each unique parameter's gradient over the stage's layers (a tied
// weight used twice in one stage counts once per use, never twice per use)
// and adds it to the parameter's CPU accumulator.
void StageBinding::download_param_grads() {
  progress_.phase = "download";
  std::unordered_map<int, at::Tensor> sums;
  for (int l = job_.range.begin; l < job_.range.end; ++l) {
    auto leaves = instances_.at(l)->parameter_leaves();
    const auto& ids = ctx_.weights.layer_param_ids(l);
    for (size_t j = 0; j < ids.size(); ++j) {
      const auto& g = leaves[j].grad();
      if (!g.defined()) continue;
      auto& sum = sums[ids[j]];
      sum = sum.defined() ? sum + g : g;
    }
  }
  std::vector<int> ids;
  std::vector<at::Tensor> grads;
  for (auto& [id, g] : sums) {
    ids.push_back(id);
    grads.push_back(g);
  }
  if (grads.empty()) {
    ctx_.grads.delivered(job_.call->grads, job_.param_ids);
    return;
  }
  auto [host, event] = device_.download(grads, ctx_.weights.host_allocator());
  job_.call->work.begin();
  const int replica = job_.replicas > 1 ? job_.replica : -1;
  // The event is waited for inside the task: a failure fails the call
  // (with its context) instead of leaving the optimizer waiting for
  // gradients that never come.
  ctx_.grad_tasks.post(nullptr, [&ledger = ctx_.grads, call = job_.call, ids, host, replica, event,
                                 delivered = job_.param_ids, stage = job_.describe(),
                                 where = device_.name(), name = ctx_.name] {
    try {
      event->synchronize();
      for (size_t i = 0; i < ids.size(); ++i) ledger.add(call->grads, ids[i], replica, host[i]);
      ledger.delivered(call->grads, delivered);
    } catch (const std::exception& e) {
      call->fail(StageError(
          name + ": " + stage + " failed on " + where + ", phase gradient download: " + e.what(),
          stage, -1, -1, "gradient download", where, false, std::current_exception()));
    }
    call->work.end();
  });
}

// A forward commits the buffer writes of its layers once, after its last
// microbatch (the fused tail too: it is a forward of its layers).
void StageBinding::commit_buffers() {
  if (!bound_) return;
  progress_.phase = "download";
  std::vector<at::Tensor> device_buffers, homes;
  for (int l = job_.range.begin; l < job_.range.end; ++l) {
    auto values = instances_.at(l)->buffer_values();
    auto home = ctx_.layers[l]->buffers();
    device_buffers.insert(device_buffers.end(), values.begin(), values.end());
    homes.insert(homes.end(), home.begin(), home.end());
  }
  if (device_buffers.empty()) return;
  auto [host, event] = device_.download(device_buffers, ctx_.weights.host_allocator());
  job_.call->work.begin();
  job_.commit_posted = true;
  // The event is waited for inside the task: whatever fails (the copy,
  // the device), the commit is settled and the call's work ends, and a
  // failure stops later calls from reading half-committed buffers.
  ctx_.host_tasks.post(nullptr, [&commits = ctx_.commits, call = job_.call, homes, host, event,
                                 layers = job_.commit_layers, name = ctx_.name] {
    struct Settle {
      CommitLedger& commits;
      CallState& call;
      const std::vector<int>& layers;
      bool ok = false;
      ~Settle() {
        commits.settle(layers, call.id, ok);
        call.work.end();
      }
    } settle{commits, *call, layers};
    try {
      event->synchronize();
      for (size_t i = 0; i < homes.size(); ++i) {
        TORCH_CHECK(homes[i].sizes() == host[i].sizes(), "a buffer of shape ", homes[i].sizes(),
                    " came back as ", host[i].sizes(),
                    ": a layer may write its buffers' values, not replace them by tensors "
                    "of another shape");
        // Seen once, a buffer write rules out replicated tails (their
        // commits would race).
        if (!commits.buffers_written() && !homes[i].equal(host[i])) commits.note_buffer_write();
        homes[i].copy_(host[i]);
      }
    } catch (const std::exception& e) {
      std::ostringstream what;
      what << name << ": the buffer commit of layers";
      for (int l : layers) what << " " << l;
      what << " (call " << call->id << ") failed: " << e.what();
      throw std::runtime_error(what.str());
    }
    // Once all of a training call's commits have landed (eval mode may
    // not write), with no write seen, replicated tails may run.
    if (--call->commits_left == 0 && call->training) commits.note_training_call_committed();
    settle.ok = true;
  });
}

}  // namespace roundpipe::detail

// One call's shared state: what its stage jobs hand each other (slots),
// its gradients, its buffer-commit and work counts, and its cancellation
// (Note [Call cancellation]); and a stage job. Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/errors.h"
#include "roundpipe/options.h"
#include "roundpipe/run_config.h"
#include "runtime/parts/gradient_ledger.h"
#include "runtime/planning/schedule.h"
#include "runtime/values/recompute_state.h"
#include "runtime/values/rng.h"
#include "support/trace.h"
#include "support/work_counter.h"

namespace roundpipe::detail {

// Unwinds a job of a call that already failed elsewhere.
struct CallAborted {};

// A value handed from one job to another through host memory: a host-side
// signal plus the device event that completes when the copy has landed.
struct Slot {
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;
  c10::IValue value;                // activations: CPU IValue
  std::vector<at::Tensor> tensors;  // gradients: flat, undefined = no gradient
  EventPtr event;
  RngState rng;
  bool released = false;  // its last reader is done: the tensors went back
};

// Everything one call (forward or forward_backward) shares between its jobs.
struct CallState {
  int64_t id = 0;    // calls so far on this engine (traces)
  RunConfig config;  // resolved
  int n = 1;         // microbatches
  ExecutePlan plan;
  bool fused = false;
  bool training = false;
  RecomputeGrain grain = RecomputeGrain::kStage;
  bool grain_chosen = false;      // by the automatic plan, not the caller
  int tail_layers_with_grad = 0;  // layer grain: of the fused tail (Note [Tail grain]); 0: one
  int tail_row_chunks = 1;        // the fused tail's chunks per microbatch (Note [Tail row chunks])
  // The loss function is the caller's, not known to add up over rows: the
  // tail checks it where it runs in chunks (Note [A caller's loss over row
  // chunks]), and sets loss_check_failed when the call must be redone whole.
  bool check_chunk_loss = false;
  std::atomic<bool> loss_check_failed{false};
  // Layer-from-stage grain: a backward stage keeps the inputs of the layers
  // it reruns on the device (Note [Thin checkpoints]): a caller's plan, or
  // an automatic one that counts them; else on the host.
  bool rerun_inputs_on_device = true;
  bool preserve_rng = true;
  uint64_t call_seed = 0;

  // act[l][m]: input of layer l for microbatch m (l == L: final output);
  // grad[l][m]: gradient of the input of layer l.
  std::map<int, std::vector<std::shared_ptr<Slot>>> act, grad;
  std::vector<std::shared_ptr<Slot>> losses, outputs;  // fused tail results
  std::vector<bool> input_requires_grad;               // per flattened input tensor
  // Packed input: microbatch m's tensors are flattened inputs [m], [m+1]).
  std::vector<size_t> packed_input_offsets;
  // Which of microbatch m's (flattened) input tensors become gradient leaves.
  std::vector<bool> microbatch_input_requires_grad(int m) const {
    if (packed_input_offsets.empty()) return input_requires_grad;
    return {input_requires_grad.begin() + packed_input_offsets[m],
            input_requires_grad.begin() + packed_input_offsets[m + 1]};
  }
  std::vector<bool> input_is_split;                  // per flattened input tensor
  std::vector<std::vector<at::Tensor>> input_grads;  // per microbatch (layer 0)
  std::vector<std::vector<int64_t>> output_rows;     // per output tensor: rows per microbatch
  std::vector<size_t> packed_offsets;  // packed output: microbatch m's tensors are [m], [m+1])
  std::vector<c10::IValue> labels;
  LossFn loss_fn;
  bool return_outputs = false;
  bool backward_done = false;

  // The buffers of a layer as the call's forward found them, before its
  // first microbatch: a backward stage's recompute binds them, and a call
  // redone after running out of memory (Note [Out-of-memory redo]) starts
  // from them. Taken by the forward side's first binding (any thread).
  void snapshot_buffers(int layer, std::vector<at::Tensor> values);
  std::vector<at::Tensor> buffer_snapshot(int layer) const;
  // Copies every snapshot back into its home (`homes(layer)`: the layer's
  // home buffers), once the call's jobs and host tasks are done.
  void restore_buffer_snapshots(
      const std::function<std::vector<at::Tensor>(int layer)>& homes) const;

  RecomputeStore recompute;  // save_for_recompute() data of its layers

  // Parameter gradients this call produced (gradient-task thread), taken
  // by a step() or synchronize() once the whole call succeeded, or by a
  // fused async step parameter by parameter as they become final
  // (the engine's GradientLedger guards it).
  CallGradients grads;
  int64_t weights_version = 0;  // the optimizer version its uploads read

  // Buffer commits of this call's forward-side jobs still to land.
  std::atomic<int> commits_left{0};
  // Jobs and host tasks of this call still to run.
  WorkCounter work;

  std::atomic<bool> aborted{false};
  // Its error already reached the caller (through the autograd backward of
  // forward()): not reported again, and its gradients are dropped.
  std::atomic<bool> reported{false};
  std::mutex error_mu;
  std::optional<StageError> error;
  std::vector<std::shared_ptr<Slot>> all_slots;

  std::shared_ptr<Slot> new_slot() {
    auto slot = std::make_shared<Slot>();
    all_slots.push_back(slot);
    return slot;
  }
  std::vector<std::shared_ptr<Slot>> new_slots() {
    std::vector<std::shared_ptr<Slot>> slots;
    for (int m = 0; m < n; ++m) slots.push_back(new_slot());
    return slots;
  }

  // Set-up (call.cpp), once config, n, plan, fused and training are set.
  // The input split into n microbatches (config's packed_input or
  // split_input, else the default split), detached; records which input
  // tensors require grad and how they were split.
  std::vector<c10::IValue> split_input(const c10::IValue& input, const std::string& name);
  // A slot for every hand-off the plan makes (`num_layers` in the model).
  void make_slots(int num_layers);
  // The microbatches into the first slots, each with its random stream.
  void put_inputs(const std::vector<c10::IValue>& microbatches);
  // The labels split as the input was (config's split_label, else the default).
  void split_labels(const c10::IValue& label, const std::string& name);

  // Note [Call cancellation]
  // A failing job calls fail() once: the error is kept, `aborted` is set,
  // and every waiter of the call is woken: its hand-off slots, and the
  // engine's waits that may be waiting on it (weights, buffer commits,
  // gradients), registered as `wakers` when the call starts. A waker takes
  // its waiters' mutex before notifying, so a waiter that checked `aborted`
  // under that mutex just before is already waiting and wakes; none polls.
  std::vector<std::function<void()>> wakers;

  void fail(StageError e) {
    {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::move(e);
    }
    aborted = true;
    for (auto& slot : all_slots) {
      std::lock_guard<std::mutex> lock(slot->mu);
      slot->cv.notify_all();
    }
    for (const auto& wake : wakers) wake();
  }
  void rethrow_if_failed() {
    std::lock_guard<std::mutex> lock(error_mu);
    if (error) throw StageError(*error);
  }
  Slot& wait(const std::shared_ptr<Slot>& slot) {
    const auto start = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(slot->mu);
    slot->cv.wait(lock, [&] { return slot->ready || aborted.load(); });
    if (!slot->ready) throw CallAborted{};
    TORCH_CHECK(!slot->released, "call ", id,
                ": internal error: a hand-off was read after its last reader released it");
    if (ms_since(start) > 0.5)
      ROUNDPIPE_TRACE("call %lld: waited %.1f ms for a hand-off", static_cast<long long>(id),
                      ms_since(start));
    return *slot;
  }
  static void put(Slot& slot, c10::IValue value, std::vector<at::Tensor> tensors, EventPtr event,
                  RngState rng) {
    std::lock_guard<std::mutex> lock(slot.mu);
    slot.value = std::move(value);
    slot.tensors = std::move(tensors);
    slot.event = std::move(event);  // recorded before the signal
    slot.rng = std::move(rng);
    slot.ready = true;
    slot.cv.notify_all();
  }
  // Note [Hand-offs end with their last reader]
  // A backward stage (or the fused tail) is the last to read its layers'
  // inputs and its output gradient for a microbatch: once it is done with
  // them, their host tensors go back to the arena. Held until the call
  // ended, they outlived it: step() keeps the call until it has taken its
  // gradients, and by then the next call's forward is filling its own
  // checkpoints, so a run held two calls' layer inputs (82.5 GiB for a 32B
  // model's 16 x 4096 tokens), and every call of an accumulation as many.
  // A copy still reading them keeps them alive on its own (Device::upload).
  static void release(const std::shared_ptr<Slot>& slot) {
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->value = c10::IValue();
    slot->tensors.clear();
    slot->released = true;
  }

 private:
  mutable std::mutex buffers_mu_;
  std::map<int, std::vector<at::Tensor>> buffer_snapshots_;  // per layer
};

// A scheduled stage job (what, where: schedule.h; its `replica` and
// `replicas` say which microbatches it runs: replica, replica + replicas,
// ...) with what dispatch and its device worker add.
struct Job : ScheduledJob {
  std::shared_ptr<CallState> call;
  std::vector<int> param_ids;  // unique parameters of the stage, set at dispatch
  bool reads_released = false;
  // Filled by the worker's uploader thread (upload_done under Worker::mu_):
  // this stage's parameters on its device, or the error of their upload.
  // A job of an aborted call is done without an upload.
  std::vector<at::Tensor> device_params;
  EventPtr params_ready;
  bool upload_done = false;
  std::exception_ptr upload_error;
  // Set by the worker (under Worker::mu_) once it has enqueued the job: the
  // compute-queue event at its end. Shared with the uploader, which must
  // not keep the job (and its call's host memory) alive.
  std::shared_ptr<EventPtr> end = std::make_shared<EventPtr>();
  // Layers whose buffer commit later calls wait for (forward side only),
  // and whether the commit was posted (else job_finished settles it).
  std::vector<int> commit_layers;
  bool commit_posted = false;
};

}  // namespace roundpipe::detail

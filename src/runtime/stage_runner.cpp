// Runs one stage job: see stage_runner.h.
#include "runtime/stage_runner.h"

#include <ATen/ops/ones_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string_view>
#include <unordered_map>

#include "roundpipe/errors.h"
#include "roundpipe/microbatch.h"
#include "runtime/allocation_meter.h"
#include "runtime/autograd_bridge.h"
#include "runtime/ivalue_tree.h"
#include "runtime/recompute_state.h"
#include "runtime/rng.h"
#include "runtime/trace.h"
#include "runtime/transfer.h"

namespace roundpipe::detail {

namespace {

void check_devices(const c10::IValue& value, const Device& device, int layer,
                   const std::string& type_name) {
  const auto expected = device.torch_device();
  for (const auto& t : flatten_tensors(value)) {
    if (!t.defined()) continue;
    TORCH_CHECK(t.device() == expected, "layer ", layer, " (", type_name, ") returned a tensor on ",
                t.device(), " while running on ", device.name(), " (", expected,
                "). A layer's temporaries and outputs must take their device from its inputs or "
                "weights, never a fixed device.");
  }
}

// Makes the floating tensors of a stage input autograd leaves.
c10::IValue make_leaves(const c10::IValue& value, const std::vector<bool>* only,
                        std::vector<at::Tensor>& leaves) {
  size_t i = 0;
  return map_tensors(value, [&](const at::Tensor& t) {
    const size_t index = i++;
    at::Tensor leaf = t;
    if (t.defined() && at::isFloatingType(t.scalar_type()) &&
        (only == nullptr || (index < only->size() && (*only)[index]))) {
      leaf = t.detach().requires_grad_(true);
    }
    leaves.push_back(leaf);
    return leaf;
  });
}

std::vector<at::Tensor> leaf_grads(const std::vector<at::Tensor>& leaves) {
  std::vector<at::Tensor> grads;
  for (const auto& l : leaves) grads.push_back(l.requires_grad() ? l.grad() : at::Tensor());
  return grads;
}

// Runs one stage job on one device; keeps the progress for error messages.
struct StageRunner {
  const StageContext& ctx;
  Job& job;
  DeviceWorker& worker;
  Device& device;
  CallState& call;
  int layer = -1;
  int microbatch = -1;
  const char* phase = "start";
  std::map<int, std::unique_ptr<LayerInstance>> instances;
  bool buffers_bound = false;
  EventPtr buffers_ready;
  // Compute intervals of this microbatch, measured on the host-task thread
  // once the last one has completed (feeds the automatic plan).
  struct Interval {
    int layer;  // -1: the whole stage's backward, shared by its layers
    LayerTimings::Kind kind;
    EventPtr start, end;
  };
  std::vector<Interval> intervals;
  int shared_from = 0;  // the first layer an interval of layer -1 is shared by
  // Running a chunk of a microbatch's rows (Note [Tail row chunks]): its
  // memory is not metered (the plan's figures are per microbatch, and a
  // chunk's fixed costs would count once per chunk).
  bool in_row_chunk = false;

  StageRunner(const StageContext& c, Job& j, DeviceWorker& w)
      : ctx(c), job(j), worker(w), device(w.device()), call(*j.call) {}

  EventPtr mark() { return device.record_timing_mark(); }

  // Hands this microbatch's intervals to the host-task thread. A stage's
  // backward without per-layer marks is shared by its layers in proportion
  // to their recompute (or forward) times.
  void flush_timings() {
    if (intervals.empty()) return;
    auto measured = std::move(intervals);
    intervals.clear();
    auto* timings = &ctx.timings;
    Device* dev = &device;
    const LayerRange range{std::max(shared_from, job.range.begin), job.range.end};
    ctx.host_tasks.post(measured.back().end, [measured, timings, dev, range] {
      // One sample per layer and kind: a microbatch run in chunks of rows
      // (Note [Tail row chunks]) adds its chunks' times up.
      std::map<std::pair<int, LayerTimings::Kind>, double> per_layer;
      std::map<int, double> recompute;
      double stage_backward = -1;
      for (const auto& i : measured) {
        const double s = dev->seconds_between(i.start, i.end);
        if (i.layer < 0) {
          stage_backward = std::max(stage_backward, 0.0) + s;
          continue;
        }
        per_layer[{i.layer, i.kind}] += s;
        if (i.kind != LayerTimings::kBackward) recompute[i.layer] += s;
      }
      for (const auto& [key, s] : per_layer) timings->add(key.first, key.second, s);
      if (stage_backward < 0) return;
      double total = 0;
      for (int l = range.begin; l < range.end; ++l) total += recompute[l];
      for (int l = range.begin; l < range.end; ++l) {
        const double share = total > 0 ? recompute[l] / total : 1.0 / range.size();
        timings->add(l, LayerTimings::kBackward, stage_backward * share);
      }
    });
  }

  ~StageRunner() {
    for (auto& [l, instance] : instances) ctx.instances.release(l, std::move(instance));
  }

  void run() {
    phase = "parameter upload";
    worker.wait_for_upload(job);
    const auto start = std::chrono::steady_clock::now();
    for (int l = job.range.begin; l < job.range.end; ++l) {
      instances[l] = ctx.instances.acquire(l, device);
    }
    if (ms_since(start) > 0.5)
      ROUNDPIPE_TRACE("call %lld: layer instances took %.1f ms", static_cast<long long>(call.id),
                      ms_since(start));
    if (job.kind == JobKind::kForward) run_forward();
    if (job.kind == JobKind::kBackward) run_backward();
    if (job.kind == JobKind::kTail) run_tail();
    layer = -1;
    microbatch = -1;
    // Buffer commits first: a next call's forward of these layers waits
    // for them, not for the gradients.
    if (job.kind != JobKind::kBackward) commit_buffers();
    if (job.kind != JobKind::kForward) download_param_grads();
  }

  // Binds the stage's parameters and buffers (home buffers, or for a
  // recompute the snapshot taken before the forward's first microbatch).
  void bind_instances() {
    if (buffers_bound) return;
    phase = "buffer commit of an earlier call";
    if (job.kind != JobKind::kBackward) wait_for_earlier_commits();
    phase = "parameter upload";
    std::unordered_map<int, at::Tensor> by_id;
    for (size_t i = 0; i < job.param_ids.size(); ++i)
      by_id[job.param_ids[i]] = job.device_params[i];
    std::vector<at::Tensor> host_buffers;
    std::vector<size_t> counts;
    for (int l = job.range.begin; l < job.range.end; ++l) {
      std::vector<at::Tensor> buffers = ctx.layers[l]->buffers();
      if (job.kind == JobKind::kBackward && !buffers.empty()) {
        std::lock_guard<std::mutex> lock(call.buffers_mu);
        auto it = call.buffer_snapshot.find(l);
        TORCH_CHECK(it != call.buffer_snapshot.end(), "no buffer snapshot for layer ", l);
        buffers = it->second;
      } else if (job.kind == JobKind::kForward && !buffers.empty()) {
        // Taken for every call: a call redone after running out of memory
        // (Note [Out-of-memory redo]) starts from these values.
        HostAllocationScope host;  // the snapshot is host memory
        std::vector<at::Tensor> snapshot;
        for (const auto& b : buffers) snapshot.push_back(b.clone());
        std::lock_guard<std::mutex> lock(call.buffers_mu);
        call.buffer_snapshot[l] = std::move(snapshot);
      }
      counts.push_back(buffers.size());
      host_buffers.insert(host_buffers.end(), buffers.begin(), buffers.end());
    }
    // On the activation queue: the parameter queue may already carry the
    // next job's upload, which this job's compute must not wait for.
    auto [device_buffers, event] = device.upload(Queue::kActUpload, host_buffers, nullptr);
    buffers_ready = event;
    size_t next = 0;
    for (int l = job.range.begin; l < job.range.end; ++l) {
      std::vector<at::Tensor> params, buffers;
      std::vector<bool> requires_grad;
      for (int id : ctx.weights.layer_param_ids(l)) {
        params.push_back(by_id.at(id));
        requires_grad.push_back(job.kind != JobKind::kForward && ctx.weights.trainable(id));
      }
      const size_t count = counts[l - job.range.begin];
      buffers.assign(device_buffers.begin() + next, device_buffers.begin() + next + count);
      next += count;
      instances[l]->bind(params, requires_grad, buffers, ctx.layers[l]->is_training());
    }
    device.wait(Queue::kCompute, job.params_ready);
    device.wait(Queue::kCompute, buffers_ready);
    buffers_bound = true;
  }

  // Waits until earlier calls have committed the buffers this job reads.
  void wait_for_earlier_commits() {
    const auto start = std::chrono::steady_clock::now();
    // A failing call wakes this wait (Note [Call cancellation]).
    if (!ctx.commits.wait_for_earlier(
            job.commit_layers, call.id, [&] { return call.aborted.load(); }, ctx.name)) {
      throw CallAborted{};
    }
    if (ms_since(start) > 0.5)
      ROUNDPIPE_TRACE("call %lld: waited %.1f ms for earlier calls' buffer commits",
                      static_cast<long long>(call.id), ms_since(start));
  }

  c10::IValue run_layer(int l, const c10::IValue& x, bool recompute) {
    layer = l;
    phase = recompute ? "recompute" : "forward";
    LayerCallScope scope(call.recompute, l, microbatch, recompute, device.torch_device(),
                         call.training);
    const bool with_grad = c10::GradMode::is_enabled();
    // The first few forwards with grad are metered: what the layer still
    // holds after one is what it keeps for its backward (the planner's
    // activation memory).
    std::optional<MeterScope> metering;
    if (with_grad && !in_row_chunk && ctx.layers[l]->meterable() && ctx.timings.wants_kept_bytes(l))
      metering.emplace();
    auto start = mark();
    auto y = instances[l]->forward(x);
    const auto* meter = metering ? metering->meter() : nullptr;
    const int64_t kept = meter ? meter->net_bytes() : -1;
    const int64_t peak = meter ? meter->peak_bytes() : -1;
    metering.reset();
    intervals.push_back(
        {l, with_grad ? LayerTimings::kRecompute : LayerTimings::kForward, start, mark()});
    check_devices(y, device, l, ctx.layers[l]->type_name());
    int64_t bytes = 0;
    for (const auto& t : flatten_tensors(y)) bytes += t.defined() ? t.nbytes() : 0;
    if (!in_row_chunk) ctx.timings.add_output_bytes(l, bytes);
    if (kept >= 0) ctx.timings.add_kept_bytes(l, kept, peak, bytes);
    return y;
  }

  // Layer l's backward: `grads` through its output `y`. The first few are
  // metered: the most it holds on the way is its working memory. Only once
  // its parameters have gradients: the first backward allocates them, and
  // the plan counts them already.
  void layer_backward(int l, const c10::IValue& y, const std::vector<at::Tensor>& grads) {
    layer = l;
    phase = "backward";
    std::optional<MeterScope> metering;
    if (!in_row_chunk && ctx.layers[l]->meterable() && ctx.timings.wants_backward_bytes(l)) {
      const auto params = instances[l]->parameter_leaves();
      if (std::all_of(params.begin(), params.end(),
                      [](const at::Tensor& p) { return !p.requires_grad() || p.grad().defined(); }))
        metering.emplace();
    }
    auto start = mark();
    backward_through(y, grads);
    intervals.push_back({l, LayerTimings::kBackward, start, mark()});
    const auto* meter = metering ? metering->meter() : nullptr;
    if (meter) ctx.timings.add_backward_bytes(l, meter->peak_bytes());
  }

  // The backward of the stage's layers from `from` on (stage grain, or the
  // tail's layers with grad): one time, shared by them in flush_timings().
  void stage_backward(int from, const c10::IValue& y, const std::vector<at::Tensor>& grads) {
    shared_from = from;
    layer = -1;
    phase = "backward";
    auto start = mark();
    backward_through(y, grads);
    intervals.push_back({-1, LayerTimings::kBackward, start, mark()});
  }

  // Input of the stage for microbatch m, uploaded and waited for by compute.
  c10::IValue load_input(Slot& slot) {
    phase = "activation upload";
    auto [x, event] = upload_value(device, slot.value, slot.event);
    bind_instances();
    device.wait(Queue::kCompute, event);
    return x;
  }

  void run_forward() {
    const auto& r = job.range;
    for (int m = 0; m < call.n; ++m) {
      microbatch = m;
      Slot& in = call.wait(call.act.at(r.begin)[m]);
      auto x = load_input(in);
      RngState out_rng;
      {
        auto lock = device.compute_lock();
        RngScope rng(device, in.rng);
        c10::NoGradGuard no_grad;
        for (int l = r.begin; l < r.end; ++l) {
          if (l > r.begin && call.act.count(l)) {
            phase = "download";
            auto [saved, event] = download_value(device, x, ctx.weights.host_allocator());
            CallState::put(*call.act.at(l)[m], saved, {}, event, rng.capture());
          }
          x = run_layer(l, x, false);
        }
        out_rng = rng.capture();
      }
      layer = -1;
      phase = "download";
      auto [out, event] = download_value(device, x, ctx.weights.host_allocator());
      CallState::put(*call.act.at(r.end)[m], out, {}, event, out_rng);
      flush_timings();
    }
  }

  // Gradient of the stage output for microbatch m, on this device.
  std::vector<at::Tensor> load_grad(int boundary, int m) {
    Slot& g = call.wait(call.grad.at(boundary)[m]);
    phase = "activation upload";
    auto [grads, event] = upload_flat(device, Queue::kActUpload, g.tensors, g.event);
    device.wait(Queue::kCompute, event);
    return grads;
  }

  // Makes the stage input's float tensors leaves; at layer 0 only the
  // caller's tensors that require grad.
  c10::IValue input_leaves(const c10::IValue& x, int l, int m, std::vector<at::Tensor>& leaves) {
    if (l > 0) return make_leaves(x, nullptr, leaves);
    const auto only = call.microbatch_input_requires_grad(m);
    return make_leaves(x, &only, leaves);
  }

  // At layer 0: the caller's inputs that require grad (forward() and
  // forward_backward() alike), kept for the engine to send upstream.
  void send_input_grads(int l, int m, const std::vector<at::Tensor>& leaves) {
    send_input_gradients(l, m, leaf_grads(leaves));
  }
  void send_input_gradients(int l, int m, const std::vector<at::Tensor>& grads) {
    if (l == 0) {
      const auto wanted = call.microbatch_input_requires_grad(m);
      if (!call.training || std::none_of(wanted.begin(), wanted.end(), [](bool w) { return w; }))
        return;
    }
    phase = "download";
    auto [host, event] = download_flat(device, grads, ctx.weights.host_allocator());
    if (l > 0) {
      CallState::put(*call.grad.at(l)[m], {}, host, event, {});
    } else {
      event->synchronize();
      call.input_grads[m] = host;
    }
  }

  void run_backward() {
    const auto& r = job.range;
    const bool layer_grain = call.grain == RecomputeGrain::kLayer;
    for (int m = 0; m < call.n; ++m) {
      microbatch = m;
      auto grads = load_grad(r.end, m);
      bind_instances();  // before a try: a retry restores the buffers it bound
      std::vector<at::Tensor> leaves;
      if (layer_grain) {
        retrying_out_of_memory(
            [&] { backward_from_layer_inputs(m, grads, leaves); },
            [&] { backward_from_stage_input(m, grads, leaves, /*by_layer=*/true); });
      } else {
        retrying_out_of_memory(
            [&] { backward_from_stage_input(m, grads, leaves, lighter_after_out_of_memory); },
            [&] { backward_from_stage_input(m, grads, leaves, /*by_layer=*/true); });
      }
      layer = -1;
      flush_timings();
      send_input_grads(r.begin, m, leaves);
    }
  }

  // Layer grain: each layer recomputed from its own input, which the
  // forward stage kept in the call's slots.
  void backward_from_layer_inputs(int m, std::vector<at::Tensor> grads,
                                  std::vector<at::Tensor>& leaves) {
    const auto& r = job.range;
    for (int l = r.end - 1; l >= r.begin; --l) {
      Slot& in = call.wait(call.act.at(l)[m]);
      auto x = load_input(in);
      leaves.clear();
      auto lock = device.compute_lock();
      RngScope rng(device, in.rng);
      c10::AutoGradMode grad_mode(true);
      auto y = run_layer(l, input_leaves(x, l, m, leaves), true);
      layer_backward(l, y, grads);
      grads = leaf_grads(leaves);
    }
  }

  // From the stage's input: all layers recomputed with grad, then one
  // backward (stage grain); or by layer, one layer's activations at a time.
  void backward_from_stage_input(int m, const std::vector<at::Tensor>& grads,
                                 std::vector<at::Tensor>& leaves, bool by_layer) {
    const auto& r = job.range;
    Slot& in = call.wait(call.act.at(r.begin)[m]);
    auto x = load_input(in);
    leaves.clear();
    auto lock = device.compute_lock();
    RngScope rng(device, in.rng);
    const int first_with_grad = by_layer ? r.end - 1 : r.begin;
    auto saved = run_keeping_inputs(r.begin, first_with_grad, x, rng, /*recompute=*/true);
    c10::AutoGradMode grad_mode(true);
    x = input_leaves(x, first_with_grad, m, leaves);
    for (int l = first_with_grad; l < r.end; ++l) x = run_layer(l, x, true);
    backward_began = true;
    if (by_layer) {
      layer_backward(r.end - 1, x, grads);
    } else {
      stage_backward(r.begin, x, grads);
    }
    backward_layer_by_layer(r.begin, saved, leaves);
  }

  // A layer's input kept for its recompute: on the host, with the random
  // state the layer started from. Local to one microbatch (the call's slots
  // would hold every microbatch's inputs until the call ends).
  struct SavedInput {
    c10::IValue value;
    EventPtr event;
    RngState rng;
  };

  // Runs layers [begin, end) on `x` without grad, keeping each one's input
  // (`recompute`: in a backward stage, this pass is a recompute of the
  // forward). This pass makes the layers' buffer writes.
  std::vector<SavedInput> run_keeping_inputs(int begin, int end, c10::IValue& x, RngScope& rng,
                                             bool recompute) {
    std::vector<SavedInput> saved;
    c10::NoGradGuard no_grad;
    for (int l = begin; l < end; ++l) {
      phase = "download";
      auto [value, event] = download_value(device, x, ctx.weights.host_allocator());
      saved.push_back({value, event, rng.capture()});
      x = run_layer(l, x, recompute);
    }
    return saved;
  }

  // Recomputes the layers whose inputs `saved` holds (first, first + 1,
  // ...), last first, and backpropagates through each the gradient that
  // `leaves` (the next layer's input leaves) received. A recompute's buffer
  // writes are undone, after its backward (which may read them): the pass
  // that saved the inputs made them. Runs inside the microbatch's RngScope.
  void backward_layer_by_layer(int first, const std::vector<SavedInput>& saved,
                               std::vector<at::Tensor>& leaves) {
    for (int l = first + static_cast<int>(saved.size()) - 1; l >= first; --l) {
      auto grads = leaf_grads(leaves);
      const auto& s = saved[l - first];
      phase = "activation upload";
      auto [input, event] = upload_value(device, s.value, s.event);
      device.wait(Queue::kCompute, event);
      apply_rng(device, s.rng);  // the scope restores the generator after
      leaves.clear();
      auto kept = clone_buffers(l);
      auto y = run_layer(l, input_leaves(input, l, microbatch, leaves), true);
      layer_backward(l, y, grads);
      restore_buffers(l, kept);
    }
  }

  std::vector<at::Tensor> clone_buffers(int l) {
    std::vector<at::Tensor> kept;
    for (const auto& b : instances[l]->buffer_values()) kept.push_back(b.clone());
    return kept;
  }

  void restore_buffers(int l, const std::vector<at::Tensor>& kept) {
    c10::NoGradGuard no_grad;
    auto now = instances[l]->buffer_values();
    for (size_t i = 0; i < kept.size(); ++i) now[i].copy_(kept[i]);
  }

  // Note [Out-of-memory retry of a microbatch]
  // A backward stage or the fused tail in stage grain holds all of its
  // layers' activations for a microbatch; where that runs out of memory
  // (after the losses have gone back, it would fail the call in the
  // background), the microbatch runs again in the same job, by layer: one
  // layer's activations at a time, from the stage input it still has, with
  // the random state it started from. The failed try is undone first: its
  // buffer writes are restored from a copy taken before it, its parameter
  // gradients dropped, its timings forgotten; it has sent nothing (input
  // gradients go after the microbatch; a loss already sent is not sent
  // again, being the same). So the results are those of a try that never
  // failed. Not retried: a plan of the caller's (theirs to change), a retry
  // that fails again, and a try that failed inside its backward after
  // earlier microbatches left gradients (its partial sum can't be told
  // apart from theirs without holding a second copy of the stage's
  // gradients); those fail the call as before (Note [Out-of-memory redo]).
  // The rest of the job runs by layer, and later calls plan smaller.
  bool lighter_after_out_of_memory = false;
  bool backward_began = false;

  template <class Try, class Retry>
  void retrying_out_of_memory(Try&& first_try, Retry&& retry) {
    std::map<int, std::vector<at::Tensor>> buffers;
    bool had_grads = false;
    for (auto& [l, instance] : instances) {
      if (buffers_bound) buffers[l] = clone_buffers(l);
      for (const auto& p : instance->parameter_leaves()) had_grads |= p.grad().defined();
    }
    const size_t timed = intervals.size();
    backward_began = false;
    try {
      first_try();
      return;
    } catch (const c10::OutOfMemoryError&) {
      if (call.config.execute_plan || (backward_began && had_grads)) throw;
    }
    ROUNDPIPE_TRACE("call %lld: %s ran out of memory in microbatch %d; retried by layer",
                    static_cast<long long>(call.id), job.describe().c_str(), microbatch);
    intervals.resize(timed);
    for (const auto& [l, kept] : buffers) restore_buffers(l, kept);
    if (job.kind == JobKind::kTail) {  // its forward's saves are made again
      std::lock_guard<std::mutex> lock(call.recompute.mu);
      for (int l = job.range.begin; l < job.range.end; ++l)
        call.recompute.data.erase({l, microbatch});
    }
    if (!had_grads) {
      for (auto& [l, instance] : instances) {
        for (auto& p : instance->parameter_leaves()) p.mutable_grad() = at::Tensor();
      }
    }
    if (!lighter_after_out_of_memory) {
      lighter_after_out_of_memory = true;
      ctx.out_of_memory_retried(call, job.describe(), device.name());
    }
    retry();
  }

  void run_tail() {
    const auto& r = job.range;
    // Layer grain holds one layer's activations at a time here too: a pass
    // without grad saves each layer's input to the host, then the last
    // layer and the loss run with grad, and each earlier layer is recomputed
    // and backpropagated, last first (as run_backward does across stages).
    // The automatic plan may run more than the last layer with grad there
    // (Note [Tail grain]), and each microbatch in chunks of rows.
    const int with_grad = call.grain == RecomputeGrain::kLayer
                              ? std::clamp(call.tail_layers_with_grad, 1, r.size())
                              : r.size();
    for (int m = job.replica; m < call.n; m += job.replicas) {
      microbatch = m;
      Slot& in = call.wait(call.act.at(r.begin)[m]);
      if (call.tail_row_chunks > 1 && run_tail_in_chunks(in, with_grad)) continue;
      auto x = load_input(in);
      phase = "activation upload";
      auto [label, label_event] = upload_value(device, call.labels[m], nullptr);
      device.wait(Queue::kCompute, label_event);
      std::vector<at::Tensor> leaves;
      bool results_sent = false;
      const auto send = [&](const at::Tensor& loss, const c10::IValue& out) {
        send_results(loss, out.isNone() ? out : download_output(out));
      };
      retrying_out_of_memory(
          [&] {
            tail_microbatch(x, label, in.rng, lighter_after_out_of_memory ? 1 : with_grad, leaves,
                            results_sent, send);
          },
          [&] { tail_microbatch(x, label, in.rng, 1, leaves, results_sent, send); });
      flush_timings();
      send_input_grads(r.begin, m, leaves);
    }
  }

  // The output of a microbatch (or of a chunk of one) on its way to the host.
  c10::IValue download_output(const c10::IValue& x) {
    phase = "download";
    auto [out, event] = download_value(
        device, map_tensors(x, [](const at::Tensor& t) { return t.defined() ? t.detach() : t; }),
        ctx.weights.host_allocator());
    output_event = event;
    return out;
  }
  EventPtr output_event;

  // The microbatch's loss (on this device) and output (on the host, after
  // output_event; None unless asked for) to the caller.
  void send_results(const at::Tensor& loss, const c10::IValue& out) {
    phase = "download";
    auto [host_loss, loss_event] =
        download_flat(device, {loss.detach().reshape({})}, ctx.weights.host_allocator());
    CallState::put(*call.losses[microbatch], {}, host_loss, loss_event, {});
    if (call.return_outputs) CallState::put(*call.outputs[microbatch], out, {}, output_event, {});
  }

  // Note [Tail row chunks] (layer.h): the microbatch's rows in chunks, one
  // chunk's activations at a time. Each chunk runs as a microbatch of its
  // own (its gradients computed apart and added once its backward is done,
  // so that one running out of memory is retried alone); the caller gets
  // the chunks' losses added and their outputs concatenated once the last
  // chunk's forward is done, and the stage before gets the chunks' input
  // gradients concatenated (summed where the chunks share a tensor).
  // False where the tail's first layer cannot split this input.
  bool run_tail_in_chunks(Slot& in, int with_grad) {
    const auto& r = job.range;
    const auto* splitter = ctx.layers[r.begin]->row_splitter();
    if (splitter == nullptr) return false;
    const auto whole = flatten_tensors(in.value);
    if (std::none_of(whole.begin(), whole.end(),
                     [](const at::Tensor& t) { return t.defined() && t.dim() > 0; }))
      return false;
    const int64_t rows = batch_size_of(in.value);
    const auto sizes =
        chunk_sizes(rows, static_cast<int>(std::min<int64_t>(call.tail_row_chunks, rows)));
    if (sizes.size() < 2) return false;
    const auto chunks = splitter->split_input_rows(in.value, sizes);
    if (chunks.empty()) return false;
    TORCH_CHECK(chunks.size() == sizes.size(), ctx.layers[r.begin]->type_name(),
                "::split_input_rows returned ", chunks.size(), " chunks for ", sizes.size(),
                " row counts");
    bind_instances();
    const int m = microbatch;
    std::vector<std::vector<at::Tensor>> grads;  // per chunk: the input gradients
    at::Tensor loss_sum;
    std::vector<c10::IValue> outputs;
    int64_t first_row = 0;
    for (size_t k = 0; k < chunks.size(); ++k) {
      in_row_chunk = true;
      phase = "activation upload";
      auto [x, event] = upload_value(device, chunks[k], in.event);
      auto [label, label_event] =
          upload_value(device, rows_of(call.labels[m], rows, first_row, sizes[k]), nullptr);
      device.wait(Queue::kCompute, event);
      device.wait(Queue::kCompute, label_event);
      first_row += sizes[k];
      const bool last = k + 1 == chunks.size();
      std::vector<at::Tensor> leaves;
      bool results_sent = false;
      const auto gather = [&](const at::Tensor& loss, const c10::IValue& out) {
        const auto part = loss.detach().reshape({});
        loss_sum = loss_sum.defined() ? loss_sum + part : part;
        if (call.return_outputs) outputs.push_back(download_output(out));
        if (!last) return;
        c10::IValue merged;
        if (call.return_outputs) {
          output_event->synchronize();  // (the earlier chunks' came before it)
          merged = merge_row_chunks(outputs);
        }
        send_results(loss_sum, merged);
      };
      retrying_out_of_memory(
          [&] {
            tail_microbatch(x, label, in.rng, lighter_after_out_of_memory ? 1 : with_grad, leaves,
                            results_sent, gather, /*apart=*/true);
          },
          [&] { tail_microbatch(x, label, in.rng, 1, leaves, results_sent, gather, true); });
      grads.push_back(leaf_grads(leaves));
    }
    in_row_chunk = false;
    flush_timings();
    // The whole input's gradients: concatenated where the chunks split a
    // tensor, summed where they share it.
    std::vector<at::Tensor> merged(whole.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      std::vector<at::Tensor> parts;
      for (const auto& g : grads)
        if (i < g.size() && g[i].defined()) parts.push_back(g[i]);
      if (parts.empty()) continue;
      TORCH_CHECK(parts.size() == grads.size(), "the tail's chunks of microbatch ", m,
                  " gave a gradient for input tensor ", i, " in some chunks only");
      if (parts[0].sizes() == whole[i].sizes()) {
        merged[i] = parts[0];
        for (size_t k = 1; k < parts.size(); ++k) merged[i] = merged[i] + parts[k];
      } else {
        merged[i] = at::cat(parts, 0);
      }
    }
    send_input_gradients(r.begin, m, merged);
    ctx.stats.count(&PipelineStats::tail_microbatches_in_row_chunks);
    return true;
  }

  // Rows [first, first + n) of a label's tensors of `rows` rows; its other
  // values as they are.
  static c10::IValue rows_of(const c10::IValue& value, int64_t rows, int64_t first, int64_t n) {
    return map_tensors(value, [&](const at::Tensor& t) {
      return t.defined() && t.dim() > 0 && t.size(0) == rows ? t.narrow(0, first, n) : t;
    });
  }

  // Chunks' outputs as the whole microbatch's (Note [Tail row chunks]):
  // tensors of one or more dimensions concatenated on dim 0, 0-dim tensors
  // added, anything else the first chunk's.
  static c10::IValue merge_row_chunks(const std::vector<c10::IValue>& outputs) {
    std::vector<std::vector<at::Tensor>> tensors;
    for (const auto& o : outputs) tensors.push_back(flatten_tensors(o));
    std::vector<at::Tensor> merged;
    for (size_t i = 0; i < tensors[0].size(); ++i) {
      std::vector<at::Tensor> parts;
      for (const auto& t : tensors) parts.push_back(t[i]);
      if (!parts[0].defined()) {
        merged.push_back(parts[0]);
      } else if (parts[0].dim() == 0) {
        auto sum = parts[0].clone();
        for (size_t k = 1; k < parts.size(); ++k) sum.add_(parts[k]);
        merged.push_back(sum);
      } else {
        merged.push_back(at::cat(parts, 0));
      }
    }
    return replace_tensors(outputs[0], merged);
  }

  // One microbatch of the fused tail: forward, loss (handed to `results`,
  // with the output, before the backward is enqueued: the caller has them,
  // and may issue the next call, while this microbatch's backward still
  // runs) and backward. The last `with_grad` layers run with grad; the
  // others run without, keeping their inputs, and are recomputed one at a
  // time. `apart`: the gradients of the layers with grad are computed apart
  // and then added (a chunk of rows, Note [Tail row chunks]).
  void tail_microbatch(const c10::IValue& input, const c10::IValue& label,
                       const RngState& rng_start, int with_grad, std::vector<at::Tensor>& leaves,
                       bool& results_sent,
                       const std::function<void(const at::Tensor&, const c10::IValue&)>& results,
                       bool apart = false) {
    const auto& r = job.range;
    leaves.clear();
    auto lock = device.compute_lock();
    RngScope rng(device, rng_start);
    const int first_with_grad = r.end - with_grad;
    c10::IValue x = input;
    auto saved = run_keeping_inputs(r.begin, first_with_grad, x, rng, /*recompute=*/false);
    c10::AutoGradMode grad_mode(true);
    x = input_leaves(x, first_with_grad, microbatch, leaves);
    for (int l = first_with_grad; l < r.end; ++l) x = run_layer(l, x, false);
    layer = -1;
    phase = "loss";
    at::Tensor loss = call.loss_fn(x, label);
    TORCH_CHECK(loss.defined() && loss.numel() == 1, "loss_fn must return a single-element ",
                "loss tensor, got ", loss.defined() ? loss.sizes() : at::IntArrayRef{});
    TORCH_CHECK(loss.device() == device.torch_device(), "loss_fn returned a loss on ",
                loss.device(), " while running on ", device.name());
    if (!results_sent) {
      results(loss, call.return_outputs ? x : c10::IValue());
      results_sent = true;
    }
    const auto root = loss.reshape({});
    const std::vector<at::Tensor> one{at::ones_like(root)};  // d loss / d loss
    if ((first_with_grad > r.begin || apart) && with_grad > 1) {
      backward_then_accumulate(first_with_grad, root, one, leaves);
    } else {
      backward_began = true;
      if (with_grad == 1) {
        layer_backward(r.end - 1, root, one);
      } else {
        stage_backward(first_with_grad, root, one);
      }
    }
    backward_began = true;  // from here gradients add up in place
    backward_layer_by_layer(r.begin, saved, leaves);
  }

  // The backward of the tail's layers with grad where they are some of its
  // layers (Note [Tail grain]): the planner filled the memory with them, so
  // a microbatch past the first may run out of memory inside this backward.
  // Their parameter gradients are computed apart and added to the
  // accumulated ones only once it has succeeded (as autograd would add
  // them), so that a retry by layer starts from exactly the gradients of
  // the earlier microbatches (Note [Out-of-memory retry of a microbatch]).
  // It costs the layers' gradient bytes once more, which the plan counts.
  void backward_then_accumulate(int from, const at::Tensor& root,
                                const std::vector<at::Tensor>& one,
                                std::vector<at::Tensor>& leaves) {
    shared_from = from;
    layer = -1;
    phase = "backward";
    std::vector<at::Tensor> params, inputs;
    for (int l = from; l < job.range.end; ++l) {
      for (const auto& p : instances[l]->parameter_leaves()) {
        if (p.requires_grad()) params.push_back(p);
      }
    }
    std::vector<size_t> leaf_index;
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (leaves[i].defined() && leaves[i].requires_grad()) {
        leaf_index.push_back(i);
        inputs.push_back(leaves[i]);
      }
    }
    inputs.insert(inputs.end(), params.begin(), params.end());
    auto start = mark();
    if (root.requires_grad() && !inputs.empty()) {
      auto grads = torch::autograd::grad({root}, inputs, one, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t i = 0; i < leaf_index.size(); ++i)
        leaves[leaf_index[i]].mutable_grad() = grads[i];
      c10::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& g = grads[leaf_index.size() + i];
        if (!g.defined()) continue;
        auto& sum = params[i].mutable_grad();
        if (sum.defined()) {
          sum.add_(g);
        } else {
          sum = g;
        }
      }
    }
    intervals.push_back({-1, LayerTimings::kBackward, start, mark()});
  }

  // Sums each unique parameter's gradient over the stage's layers (a tied
  // weight used twice in one stage counts once per use, never twice per use)
  // and adds it to the parameter's CPU accumulator.
  void download_param_grads() {
    phase = "download";
    std::unordered_map<int, at::Tensor> sums;
    for (int l = job.range.begin; l < job.range.end; ++l) {
      auto leaves = instances[l]->parameter_leaves();
      const auto& ids = ctx.weights.layer_param_ids(l);
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
      ctx.grads.delivered(job.call->grads, job.param_ids);
      return;
    }
    auto [host, event] = device.download(grads, ctx.weights.host_allocator());
    job.call->work.begin();
    const int replica = job.replicas > 1 ? job.replica : -1;
    // The event is waited for inside the task: a failure fails the call
    // (with its context) instead of leaving the optimizer waiting for
    // gradients that never come.
    ctx.grad_tasks.post(nullptr, [&ledger = ctx.grads, call = job.call, ids, host, replica, event,
                                  delivered = job.param_ids, stage = job.describe(),
                                  where = device.name(), name = ctx.name] {
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
  void commit_buffers() {
    if (!buffers_bound) return;
    phase = "download";
    std::vector<at::Tensor> device_buffers, homes;
    for (int l = job.range.begin; l < job.range.end; ++l) {
      auto values = instances[l]->buffer_values();
      auto home = ctx.layers[l]->buffers();
      device_buffers.insert(device_buffers.end(), values.begin(), values.end());
      homes.insert(homes.end(), home.begin(), home.end());
    }
    if (device_buffers.empty()) return;
    auto [host, event] = device.download(device_buffers, ctx.weights.host_allocator());
    job.call->work.begin();
    job.commit_posted = true;
    // The event is waited for inside the task: whatever fails (the copy,
    // the device), the commit is settled and the call's work ends, and a
    // failure stops later calls from reading half-committed buffers.
    ctx.host_tasks.post(nullptr, [&commits = ctx.commits, call = job.call, homes, host, event,
                                  layers = job.commit_layers, name = ctx.name] {
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
};

}  // namespace

void run_stage_job(const StageContext& ctx, Job& job, DeviceWorker& worker) {
  auto& call = *job.call;
  if (call.aborted) return;
  StageRunner runner(ctx, job, worker);
  auto fail = [&](const std::string& what, bool oom) {
    std::ostringstream msg;
    msg << ctx.name << ": " << job.describe() << " failed on " << worker.device().name();
    if (runner.layer >= 0) {
      msg << " in layer " << runner.layer << " (" << ctx.layers[runner.layer]->type_name() << ")";
    }
    if (runner.microbatch >= 0) msg << ", microbatch " << runner.microbatch;
    msg << ", phase " << runner.phase << ": " << what;
    if (oom && std::string_view(runner.phase) == "loss") {
      msg << "\nThe loss function runs on a whole microbatch's output; a loss over full logits "
             "takes several times their size. Use more microbatches (num_microbatch), or a loss "
             "that never holds the logits (a preset's own: labels in input_kwargs, "
             "loss_fn=lambda o, _: o.loss / num_microbatch).";
    }
    call.fail(StageError(msg.str(), job.describe(), runner.layer, runner.microbatch, runner.phase,
                         worker.device().name(), oom, std::current_exception()));
  };
  try {
    runner.run();
  } catch (const CallAborted&) {
  } catch (const c10::OutOfMemoryError& e) {
    fail(e.what_without_backtrace(), true);
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace(), false);
  } catch (const std::exception& e) {
    fail(e.what(), false);
  } catch (...) {
    fail("unknown exception", false);
  }
  job.device_params.clear();
}

// ---------------------------------------------------------------- calls

}  // namespace roundpipe::detail

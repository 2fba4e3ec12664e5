// A backward stage, and a microbatch's steps (microbatch_steps.h) as the
// backward stage and the fused tail run them: see stage_run.h.
#include <ATen/ops/ones_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <optional>

#include "runtime/memory/allocation_meter.h"
#include "runtime/stage/stage_run.h"
#include "runtime/values/ivalue_tree.h"
#include "runtime/values/transfer.h"
#include "support/trace.h"

namespace roundpipe::detail {

namespace {

// Makes the floating tensors of a stage input autograd leaves (`only`: of
// the flattened tensors, those marked).
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

}  // namespace

std::vector<at::Tensor> leaf_grads(const std::vector<at::Tensor>& leaves) {
  std::vector<at::Tensor> grads;
  for (const auto& l : leaves) grads.push_back(l.requires_grad() ? l.grad() : at::Tensor());
  return grads;
}

// At layer 0 only the caller's tensors that require grad become leaves.
c10::IValue StageRun::input_leaves(const c10::IValue& x, int l, std::vector<at::Tensor>& leaves) {
  if (l > 0) return make_leaves(x, nullptr, leaves);
  const auto only = call.microbatch_input_requires_grad(where.microbatch);
  return make_leaves(x, &only, leaves);
}

void StageRun::run_backward() {
  const auto& r = job.range;
  const auto steps = backward_stage_steps(r, call.grain, call.rerun_inputs_on_device);
  for (int m = 0; m < call.n; ++m) {
    where.microbatch = m;
    auto grads = binding.load_grad(r.end, m);
    binding.bind();  // before a try: a retry restores the buffers it bound
    std::vector<at::Tensor> leaves;
    run_retrying(steps, [&](const MicrobatchSteps& s) {
      if (s.each_layer_from_its_input) {
        run_each_layer_from_its_input(s, grads, leaves);
        return;
      }
      Slot& in = call.wait(call.act.at(r.begin)[m]);
      auto x = binding.load_input(in);
      run_steps(s, x, in.rng, grads, nullptr, leaves);
    });
    where.layer = -1;
    timer.flush(r);
    binding.send_input_gradients(r.begin, m, leaf_grads(leaves));
    release_read_hand_offs();
  }
}

void StageRun::release_read_hand_offs() {
  const int m = where.microbatch;
  for (int l = job.range.begin; l < job.range.end; ++l) {
    if (auto it = call.act.find(l); it != call.act.end()) CallState::release(it->second[m]);
  }
  if (auto it = call.grad.find(job.range.end); it != call.grad.end())
    CallState::release(it->second[m]);
}

void StageRun::run_retrying(const MicrobatchSteps& steps,
                            const std::function<void(const MicrobatchSteps&)>& run_one) {
  const auto undo_point = [&] {
    OutOfMemoryRetry::UndoPoint point;
    std::map<int, std::vector<at::Tensor>> buffers;
    for (const auto& [l, instance] : binding.instances()) {
      if (binding.bound()) buffers[l] = binding.clone_buffers(l);
      for (const auto& p : instance->parameter_leaves()) point.had_gradients |= p.grad().defined();
    }
    point.undo = [this, buffers = std::move(buffers), timed = timer.count(),
                  had_gradients = point.had_gradients] {
      ROUNDPIPE_TRACE("call %lld: %s ran out of memory in microbatch %d; retried by layer",
                      static_cast<long long>(call.id), job.describe().c_str(), where.microbatch);
      timer.forget_after(timed);
      for (const auto& [l, kept] : buffers) binding.restore_buffers(l, kept);
      if (job.kind == JobKind::kTail)  // its forward's saves are made again
        call.recompute.forget(job.range.begin, job.range.end, where.microbatch);
      if (!had_gradients) {
        for (const auto& [l, instance] : binding.instances()) {
          for (auto& p : instance->parameter_leaves()) p.mutable_grad() = at::Tensor();
        }
      }
    };
    return point;
  };
  const auto first = retry.lighter() ? after_out_of_memory(steps) : steps;
  retry.run(
      undo_point, [&] { run_one(first); }, [&] { run_one(by_layer(steps)); },
      [&](const std::string& message) {
        ctx.out_of_memory_retried(call, job.describe(), device.name(), message);
      });
}

// Layer grain: each layer recomputed from its own input, which the forward
// stage kept in the call's slots, and backpropagated, last first.
void StageRun::run_each_layer_from_its_input(const MicrobatchSteps& steps,
                                             std::vector<at::Tensor> grads,
                                             std::vector<at::Tensor>& leaves) {
  const auto& r = steps.layers;
  for (int l = r.end - 1; l >= r.begin; --l) {
    Slot& in = call.wait(call.act.at(l)[where.microbatch]);
    auto x = binding.load_input(in);
    leaves.clear();
    auto lock = device.compute_lock();
    RngScope rng(device, in.rng);
    c10::AutoGradMode grad_mode(true);
    auto y = run_layer(l, input_leaves(x, l, leaves), /*recompute=*/true, steps.metered);
    retry.backward_began();
    layer_backward(l, y, grads, steps.metered);
    grads = leaf_grads(leaves);
  }
}

void StageRun::run_steps(const MicrobatchSteps& s, const c10::IValue& input,
                         const RngState& rng_start, const std::vector<at::Tensor>& output_grads,
                         TailResults* tail, std::vector<at::Tensor>& leaves) {
  TORCH_CHECK(!s.each_layer_from_its_input && s.loss == (tail != nullptr),
              "stage runner: steps it cannot run: ", s.describe());
  const auto& r = s.layers;
  leaves.clear();
  auto lock = device.compute_lock();
  RngScope rng(device, rng_start);
  c10::IValue x = input;
  auto saved = run_keeping_inputs(r.begin, s.first_with_grad, x, rng, s);
  c10::AutoGradMode grad_mode(true);
  x = input_leaves(x, s.first_with_grad, leaves);
  for (int l = s.first_with_grad; l < r.end; ++l) x = run_layer(l, x, s.recompute, s.metered);
  std::vector<at::Tensor> grads = output_grads;
  at::Tensor root;
  if (s.loss) {
    root = run_loss(x, *tail);
    x = root;
    grads = {at::ones_like(root)};  // d loss / d loss
  }
  // From here gradients add up in place: a try that runs out of memory
  // after an earlier microbatch left gradients fails the call, which is
  // redone (the tail holds its last microbatch's loss until this is done:
  // Note [Out-of-memory retry of a microbatch]).
  retry.backward_began();
  if (s.backward == BackwardKind::kLastLayer) {
    layer_backward(r.end - 1, x, grads, s.metered);
  } else {
    shared_backward(s.first_with_grad, x, grads);
  }
  backward_layer_by_layer(r.begin, saved, leaves, s.metered);
}

// Runs layers [begin, end) on `x` without grad, keeping each one's input
// with the random state it starts from: on the host, or where
// `steps.inputs_on_device`, the device tensors themselves (a layer never
// writes its input in place: a forward stage downloads it while the layer
// runs). `steps.recompute`: in a backward stage, this pass repeats the
// forward. This pass makes the layers' buffer writes. Local to one
// microbatch (the call's slots would hold every microbatch's inputs until
// the call ends).
std::vector<StageRun::SavedInput> StageRun::run_keeping_inputs(int begin, int end, c10::IValue& x,
                                                               RngScope& rng,
                                                               const MicrobatchSteps& steps) {
  std::vector<SavedInput> saved;
  c10::NoGradGuard no_grad;
  for (int l = begin; l < end; ++l) {
    if (steps.inputs_on_device) {
      saved.push_back({x, nullptr, rng.capture(), /*on_device=*/true});
    } else {
      where.phase = "download";
      auto [value, event] = download_value(device, x, ctx.weights.host_allocator());
      saved.push_back({value, event, rng.capture()});
    }
    x = run_layer(l, x, steps.recompute, steps.metered);
  }
  return saved;
}

// Recomputes the layers whose inputs `saved` holds (first, first + 1,
// ...), last first, and backpropagates through each the gradient that
// `leaves` (the next layer's input leaves) received. A recompute's buffer
// writes are undone, after its backward (which may read them): the pass
// that saved the inputs made them. Runs inside the microbatch's RngScope.
void StageRun::backward_layer_by_layer(int first, std::vector<SavedInput>& saved,
                                       std::vector<at::Tensor>& leaves, bool metered) {
  for (int l = first + static_cast<int>(saved.size()) - 1; l >= first; --l) {
    auto grads = leaf_grads(leaves);
    auto& s = saved[l - first];
    c10::IValue input;
    if (!s.on_device) {
      where.phase = "activation upload";
      auto [uploaded, event] = upload_value(device, s.value, s.event);
      device.wait(Queue::kCompute, event);
      input = std::move(uploaded);
    } else {
      input = std::move(s.value);  // on the device: its memory goes once the layer is done
    }
    s.value = c10::IValue();
    apply_rng(device, s.rng);  // the scope restores the generator after
    leaves.clear();
    auto kept = binding.clone_buffers(l);
    auto y = run_layer(l, input_leaves(input, l, leaves), /*recompute=*/true, metered);
    layer_backward(l, y, grads, metered);
    binding.restore_buffers(l, kept);
  }
}

// Layer l's backward: `grads` through its output `y`. The first few are
// metered: the most it holds on the way is its working memory. Only once
// its parameters have gradients: the first backward allocates them, and
// the plan counts them already.
void StageRun::layer_backward(int l, const c10::IValue& y, const std::vector<at::Tensor>& grads,
                              bool metered) {
  where.layer = l;
  where.phase = "backward";
  std::optional<MeterScope> metering;
  bool trainable = false, allocates_gradients = false;
  // (Asked before the parameters are looked at: once both are measured,
  // later calls skip that.)
  const bool meterable = metered && ctx.layers[l]->meterable();
  const bool wants_later = meterable && ctx.timings.wants_backward_bytes(l);
  const bool wants_first = meterable && ctx.timings.wants_first_backward_bytes(l);
  if (wants_later || wants_first) {
    const auto params = binding.instance(l).parameter_leaves();
    trainable = std::any_of(params.begin(), params.end(),
                            [](const at::Tensor& p) { return p.requires_grad(); });
    allocates_gradients = !std::all_of(params.begin(), params.end(), [](const at::Tensor& p) {
      return !p.requires_grad() || p.grad().defined();
    });
    if (allocates_gradients ? wants_first : wants_later) metering.emplace();
  }
  auto start = timer.mark();
  backward_through(y, grads);
  timer.add(l, LayerTimings::kBackward, start, timer.mark());
  const auto* meter = metering ? metering->meter() : nullptr;
  // (A backward that allocated the gradients stands in until one after it
  // is measured: Note [Backward working memory], Note [One microbatch a
  // call].)
  if (meter && allocates_gradients) {
    int64_t incoming = 0;
    for (const auto& g : grads) incoming += g.defined() ? g.nbytes() : 0;
    ctx.timings.add_first_backward_bytes(l, meter->peak_bytes(), incoming);
  }
  if (meter && !allocates_gradients)
    ctx.timings.add_backward_bytes(l, meter->peak_bytes(), trainable);
}

// One backward through the layers from `first` on: one time, shared by
// them (StageTimer::flush).
void StageRun::shared_backward(int first, const c10::IValue& y,
                               const std::vector<at::Tensor>& grads) {
  where.layer = -1;
  where.phase = "backward";
  auto start = timer.mark();
  backward_through(y, grads);
  timer.add_shared_backward(first, start, timer.mark());
}

}  // namespace roundpipe::detail

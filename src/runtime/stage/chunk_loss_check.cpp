// A caller's loss function on a fused tail's chunks of rows, checked: see
// stage_run.h and the Note below.
#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <sstream>
#include <stdexcept>

#include "roundpipe/options.h"
#include "runtime/stage/stage_run.h"
#include "runtime/values/ivalue_tree.h"
#include "runtime/values/transfer.h"

namespace roundpipe {
namespace {
thread_local bool loss_reported = true;
}  // namespace

bool loss_value_is_reported() {
  return loss_reported;
}

namespace detail {

// Note [A caller's loss over row chunks]
// The fused tail may run a microbatch in chunks of rows (Note [Tail row
// chunks]) where the loss adds up over rows. The presets' own loss does;
// a loss function of the caller's may be anything, yet the original's
// idiom is one: loss_fn=lambda o, _: o.loss / num_microbatch. So such a
// function is run on each chunk's output apart from the model: on a
// detached copy, for its gradient g_k there, which is then backpropagated
// into the chunk (through the root sum(out * g_k)). By the chain rule the
// chunks' parameter gradients are the whole microbatch's exactly when
// every g_k equals the function's gradient at the merged output (its 0-dim
// tensors added over the chunks), and the tail checks just that:
//   - Learning: the first tail that runs the function on a whole
//     microbatch (the first call's, before chunks are planned for it) also
//     takes its gradient at that output and at twice it. Where the output
//     holds other than 0-dim tensors, or the two differ (the function is
//     not linear there: a square, a log), tails stay whole for good.
//   - Checking: at the last chunk's forward, before its backward and
//     before the loss goes to the caller, the function runs at the merged
//     output: that value is the microbatch's loss (what a whole run gives,
//     but for the order of the additions), and its gradient must equal
//     every chunk's bit for bit, as a linear function's constant gradient
//     does. Where one differs, the call fails and is redone with whole
//     microbatches, and later calls run them whole (a warning says so).
// The function is thus called once per chunk besides once per microbatch
// (and twice more when learning); loss_value_is_reported() (options.h) is
// false in those extra calls.

namespace {

// Sets loss_value_is_reported() for one call of the loss function.
class ReportedScope {
 public:
  explicit ReportedScope(bool reported) : before_(loss_reported) { loss_reported = reported; }
  ~ReportedScope() { loss_reported = before_; }
  ReportedScope(const ReportedScope&) = delete;
  ReportedScope& operator=(const ReportedScope&) = delete;

 private:
  bool before_;
};

struct LossAt {
  at::Tensor value;               // detached
  std::vector<at::Tensor> grads;  // per output tensor; undefined: none (zero)
};

// The loss function at `tensors` (detached ones, put in `structure`'s
// places, as leaves where `needs_grad`), its value and gradient.
LossAt loss_at(const LossFn& loss_fn, const c10::IValue& structure,
               const std::vector<at::Tensor>& tensors, const std::vector<bool>& needs_grad,
               const c10::IValue& label, bool reported) {
  std::vector<at::Tensor> leaves, inputs;
  std::vector<size_t> where;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto leaf = tensors[i].defined() ? tensors[i].detach() : tensors[i];  // (its own leaf)
    if (leaf.defined() && needs_grad[i]) {
      leaf.requires_grad_(true);
      inputs.push_back(leaf);
      where.push_back(i);
    }
    leaves.push_back(leaf);
  }
  c10::AutoGradMode grad_mode(true);
  at::Tensor value;
  {
    ReportedScope scope(reported);
    value = loss_fn(replace_tensors(structure, leaves), label);
  }
  TORCH_CHECK(value.defined() && value.numel() == 1,
              "loss_fn must return a single-element loss tensor, got ",
              value.defined() ? value.sizes() : at::IntArrayRef{});
  LossAt out{value.detach().reshape({}), std::vector<at::Tensor>(tensors.size())};
  if (inputs.empty() || !value.requires_grad()) return out;
  const auto grads = torch::autograd::grad({value.reshape({})}, inputs, {}, /*retain_graph=*/false,
                                           /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t j = 0; j < grads.size(); ++j) out.grads[where[j]] = grads[j];
  return out;
}

bool same_gradient(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return a.sizes() == b.sizes() && at::equal(a, b);
}

bool all_zero_dim(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors)
    if (t.defined() && t.dim() != 0) return false;
  return true;
}

std::vector<at::Tensor> detached(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.defined() ? t.detach() : t);
  return out;
}

}  // namespace

void StageRun::learn_callers_loss(const c10::IValue& output, const c10::IValue& label) {
  const auto tensors = flatten_tensors(output);
  std::vector<bool> needs_grad;
  for (const auto& t : tensors) needs_grad.push_back(t.defined() && t.requires_grad());
  bool chunks = all_zero_dim(tensors);
  if (chunks) {
    const auto values = detached(tensors);
    std::vector<at::Tensor> twice;
    for (const auto& t : values) twice.push_back(t.defined() ? t * 2 : t);
    const auto structure = replace_tensors(output, values);
    try {
      const auto here = loss_at(call.loss_fn, structure, values, needs_grad, label, false);
      const auto there = loss_at(call.loss_fn, structure, twice, needs_grad, label, false);
      for (size_t i = 0; i < tensors.size() && chunks; ++i)
        chunks = same_gradient(here.grads[i], there.grads[i]);
    } catch (const std::exception&) {
      // (It ran on the model's output; on a detached copy it may not, e.g.
      // writing in place into what is now a leaf: it keeps whole tails.)
      chunks = false;
    }
  }
  int unknown = kCallersLossUnknown;
  ctx.callers_loss.compare_exchange_strong(unknown,
                                           chunks ? kCallersLossChunks : kCallersLossWhole);
}

at::Tensor StageRun::run_checked_loss(const c10::IValue& output, TailResults& tail) {
  auto& c = *tail.check;
  const auto tensors = flatten_tensors(output);
  auto fail = [&](const std::string& why) {
    ctx.callers_loss = kCallersLossWhole;
    call.loss_check_failed = true;
    TORCH_WARN(ctx.name, ": the fused tail ran microbatch ", where.microbatch,
               " in chunks of rows, but the loss function ", why,
               ": the call is redone with whole microbatches, and later calls run them whole "
               "(Note [A caller's loss over row chunks])");
    throw std::runtime_error("the loss function " + why + " (the call is redone whole)");
  };
  if (!all_zero_dim(tensors)) fail("got an output holding tensors of more than 0 dimensions");
  const auto values = detached(tensors);
  if (c.chunk == 0) {
    c.detached = replace_tensors(output, values);
    c.needs_grad.clear();
    for (const auto& t : tensors) c.needs_grad.push_back(t.defined() && t.requires_grad());
    c.outputs.assign(c.chunks, {});
    c.grads.assign(c.chunks, {});
  }
  TORCH_CHECK(tensors.size() == c.needs_grad.size(), "the tail's chunks of rows gave outputs of ",
              c.needs_grad.size(), " and ", tensors.size(), " tensors");
  // (An error on a detached copy, where the model's output did not raise
  // one when it was learned: the whole microbatch shows the real one.)
  auto guarded = [&](const auto& run) {
    try {
      return run();
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const std::exception& e) {
      fail(std::string("raised an error on a chunk (") + e.what() + ")");
    }
    return LossAt{};
  };
  const auto at_chunk = guarded([&] {
    return loss_at(call.loss_fn, c.detached, values, c.needs_grad, tail.label,
                   /*reported=*/false);
  });
  c.outputs[c.chunk] = values;
  c.grads[c.chunk] = at_chunk.grads;
  // The root whose backward puts g_k into the chunk's output.
  at::Tensor root;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!at_chunk.grads[i].defined() || !tensors[i].requires_grad()) continue;
    const auto term = (tensors[i] * at_chunk.grads[i]).sum();
    root = root.defined() ? root + term : term;
  }
  if (c.chunk + 1 == c.chunks && !tail.sent) {
    std::vector<at::Tensor> merged(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      for (const auto& chunk : c.outputs) {
        if (!chunk[i].defined()) continue;
        merged[i] = merged[i].defined() ? merged[i] + chunk[i] : chunk[i];
      }
    }
    const auto whole = guarded([&] {
      return loss_at(call.loss_fn, c.detached, merged, c.needs_grad, c.label, /*reported=*/true);
    });
    for (int k = 0; k < c.chunks; ++k) {
      for (size_t i = 0; i < merged.size(); ++i) {
        if (same_gradient(c.grads[k][i], whole.grads[i])) continue;
        std::ostringstream why;
        why << "has another gradient at chunk " << k << "'s output than at the microbatch's";
        fail(why.str());
      }
    }
    tail.send(whole.value,
              call.return_outputs ? replace_tensors(c.detached, merged) : c10::IValue());
    tail.sent = true;
  }
  return root.defined() ? root : at_chunk.value;
}

}  // namespace detail
}  // namespace roundpipe

// The fused tail: each of its microbatches' forward, loss and backward in
// one job (whole, or in chunks of rows: row_chunks.cpp): see stage_run.h.
#include <c10/util/Exception.h>

#include "runtime/stage/stage_run.h"
#include "runtime/values/transfer.h"

namespace roundpipe::detail {

// Layer grain holds one layer's activations at a time here too: a pass
// without grad saves each layer's input to the host, then the last layer
// and the loss run with grad, and each earlier layer is recomputed and
// backpropagated, last first (as a backward stage does across stages). The
// automatic plan may run more than the last layer with grad there (Note
// [Tail grain]), and each microbatch in chunks of rows.
void StageRun::run_tail() {
  const auto& r = job.range;
  const int with_grad = tail_layers_with_grad(r, call.grain, call.tail_layers_with_grad);
  const auto steps = tail_steps(r, with_grad, /*row_chunk=*/false);
  for (int m = job.replica; m < call.n; m += job.replicas) {
    where.microbatch = m;
    // The job's last microbatch hands its loss over once its backward is
    // done (StageBinding::hold_results): until every tail job's has, the
    // call has returned nothing and can be redone.
    binding.hold_results(m + job.replicas >= call.n);
    Slot& in = call.wait(call.act.at(r.begin)[m]);
    if (call.tail_row_chunks > 1 && run_tail_in_chunks(in, with_grad)) {
      binding.release_results();
      release_read_hand_offs();
      continue;
    }
    auto x = binding.load_input(in);
    where.phase = "activation upload";
    auto [label, label_event] = upload_value(device, call.labels[m], nullptr);
    device.wait(Queue::kCompute, label_event);
    std::vector<at::Tensor> leaves;
    TailResults results{label, [&](const at::Tensor& loss, const c10::IValue& out) {
                          binding.send_results(m, loss,
                                               out.isNone() ? out : binding.download_output(out));
                        }};
    run_retrying(steps,
                 [&](const MicrobatchSteps& s) { run_steps(s, x, in.rng, {}, &results, leaves); });
    timer.flush(r);
    binding.send_input_gradients(r.begin, m, leaf_grads(leaves));
    binding.release_results();
    release_read_hand_offs();
  }
}

// The loss of the microbatch's output, handed to the caller with the
// output before its backward is enqueued (once, also across a retry; the
// tail's last microbatch's once its backward is done).
at::Tensor StageRun::run_loss(const c10::IValue& output, TailResults& tail) {
  where.layer = -1;
  where.phase = "loss";
  if (tail.check != nullptr) return run_checked_loss(output, tail);
  at::Tensor loss = call.loss_fn(output, tail.label);
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "loss_fn must return a single-element ",
              "loss tensor, got ", loss.defined() ? loss.sizes() : at::IntArrayRef{});
  TORCH_CHECK(loss.device() == device.torch_device(), "loss_fn returned a loss on ", loss.device(),
              " while running on ", device.name());
  if (!tail.sent) {
    tail.send(loss, call.return_outputs ? output : c10::IValue());
    tail.sent = true;
    // (Once, on a whole microbatch of a tail that could split its rows.)
    if (call.check_chunk_loss && ctx.callers_loss == kCallersLossUnknown &&
        ctx.layers[job.range.begin]->row_splitter() != nullptr)
      learn_callers_loss(output, tail.label);
  }
  return loss.reshape({});
}

}  // namespace roundpipe::detail

// A fused tail's microbatch in chunks of rows: the pure cut-and-merge
// functions (row_chunks.h) and the stage runner's chunk loop (stage_run.h).
#include "runtime/stage/row_chunks.h"

#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "roundpipe/microbatch.h"
#include "runtime/stage/stage_run.h"
#include "runtime/values/ivalue_tree.h"
#include "runtime/values/recompute_state.h"
#include "runtime/values/transfer.h"

namespace roundpipe::detail {

c10::IValue rows_of(const c10::IValue& value, int64_t rows, int64_t first, int64_t n) {
  return map_tensors(value, [&](const at::Tensor& t) {
    return t.defined() && t.dim() > 0 && t.size(0) == rows ? t.narrow(0, first, n) : t;
  });
}

c10::IValue merge_row_chunks(const std::vector<c10::IValue>& outputs) {
  TORCH_CHECK(!outputs.empty(), "merge_row_chunks: no chunks");
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

std::vector<at::Tensor> merge_chunk_input_grads(
    const std::vector<std::vector<at::Tensor>>& chunk_grads, const std::vector<at::Tensor>& whole,
    int microbatch) {
  std::vector<at::Tensor> merged(whole.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    std::vector<at::Tensor> parts;
    for (const auto& g : chunk_grads)
      if (i < g.size() && g[i].defined()) parts.push_back(g[i]);
    if (parts.empty()) continue;
    TORCH_CHECK(parts.size() == chunk_grads.size(), "the tail's chunks of microbatch ", microbatch,
                " gave a gradient for input tensor ", i, " in some chunks only");
    if (parts[0].sizes() == whole[i].sizes()) {
      merged[i] = parts[0];
      for (size_t k = 1; k < parts.size(); ++k) merged[i] = merged[i] + parts[k];
    } else {
      merged[i] = at::cat(parts, 0);
    }
  }
  return merged;
}

// Note [Tail row chunks] (layer.h): the microbatch's rows in chunks, one
// chunk's activations at a time. Each chunk runs as a microbatch of its
// own (one that runs out of memory before its backward is retried alone;
// in its backward, after earlier chunks or microbatches left gradients,
// it fails the call, which is redone); the caller gets
// the chunks' losses added and their outputs concatenated once the last
// chunk's forward is done, and the stage before gets the chunks' input
// gradients concatenated (summed where the chunks share a tensor).
bool StageRun::run_tail_in_chunks(Slot& in, int with_grad) {
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
  binding.bind();
  const int m = where.microbatch;
  const auto steps = tail_steps(r, with_grad, /*row_chunk=*/true);
  std::vector<std::vector<at::Tensor>> grads;  // per chunk: the input gradients
  at::Tensor loss_sum;
  std::vector<c10::IValue> outputs;
  // A caller's loss function: checked (Note [A caller's loss over row chunks]).
  ChunkLossCheck check;
  if (call.check_chunk_loss) {
    check.chunks = static_cast<int>(chunks.size());
    auto [label, label_event] = upload_value(device, call.labels[m], nullptr);
    device.wait(Queue::kCompute, label_event);
    check.label = label;
  }
  int64_t first_row = 0;
  for (size_t k = 0; k < chunks.size(); ++k) {
    const RowChunkScope rows_of_chunk(rows, sizes[k]);  // (row_chunk_scale())
    where.phase = "activation upload";
    auto [x, event] = upload_value(device, chunks[k], in.event);
    auto [label, label_event] =
        upload_value(device, rows_of(call.labels[m], rows, first_row, sizes[k]), nullptr);
    device.wait(Queue::kCompute, event);
    device.wait(Queue::kCompute, label_event);
    first_row += sizes[k];
    const bool last = k + 1 == chunks.size();
    std::vector<at::Tensor> leaves;
    check.chunk = static_cast<int>(k);
    TailResults results{label, [&](const at::Tensor& loss, const c10::IValue& out) {
                          const auto part = loss.detach().reshape({});
                          loss_sum = loss_sum.defined() ? loss_sum + part : part;
                          if (call.return_outputs) outputs.push_back(binding.download_output(out));
                          if (!last) return;
                          c10::IValue merged;
                          if (call.return_outputs) {
                            // (the earlier chunks' came before it)
                            binding.output_event()->synchronize();
                            merged = merge_row_chunks(outputs);
                          }
                          binding.send_results(m, loss_sum, merged);
                        }};
    // (Checked, the loss function's value at the merged output comes once,
    // at the last chunk: the sum and merge above take it as it is.)
    if (call.check_chunk_loss) results.check = &check;
    run_retrying(steps,
                 [&](const MicrobatchSteps& s) { run_steps(s, x, in.rng, {}, &results, leaves); });
    grads.push_back(leaf_grads(leaves));
  }
  timer.flush(r);
  binding.send_input_gradients(r.begin, m, merge_chunk_input_grads(grads, whole, m));
  ctx.stats.count(&PipelineStats::tail_microbatches_in_row_chunks);
  return true;
}

}  // namespace roundpipe::detail

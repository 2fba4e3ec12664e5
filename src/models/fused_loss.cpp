// Chunked linear + cross-entropy: forward and backward one token chunk at a
// time, so the [tokens, vocab] logits never exist whole.
//
// Plain path (CPU, simulated devices): the logits of a chunk are recomputed
// in backward. CUDA path: when a gradient is wanted, forward computes it too,
// chunk by chunk, with a fused kernel that turns a chunk's logits into its
// loss and, in place, its gradient, so no logits are recomputed and no
// float32 copy of them is made; backward only scales by the incoming
// gradient. Nothing waits on the host (the token count stays on the device).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "roundpipe/models/causal_lm.h"
#include "roundpipe/models/fused_ops.h"
#include "roundpipe/recompute.h"

#ifdef ROUNDPIPE_WITH_CUDA
#include "models/fused_launch.h"
#endif

namespace roundpipe::models {
namespace {

struct ChunkedLinearCrossEntropy : torch::autograd::Function<ChunkedLinearCrossEntropy> {
  // divisor > 0: the sum over tokens divided by it; else the mean over
  // this call's labelled tokens.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels, int64_t chunk,
                            double divisor) {
    const int64_t n = hidden.size(0);
    const double count =
        divisor > 0 ? divisor : std::max<int64_t>(labels.ne(-100).sum().item<int64_t>(), 1);
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      auto logits = at::matmul(hidden.narrow(0, start, len), weight.t()).to(at::kFloat);
      total = total + at::cross_entropy_loss(logits, labels.narrow(0, start, len), {},
                                             at::Reduction::Sum, -100);
    }
    ctx->save_for_backward({hidden, weight, labels});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["count"] = count;
    return total / count;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    const auto& hidden = saved[0];
    const auto& weight = saved[1];
    const auto& labels = saved[2];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const double count = ctx->saved_data["count"].toDouble();
    const auto scale = grad_out[0].to(at::kFloat) / count;
    auto grad_hidden = at::zeros_like(hidden);
    auto grad_weight = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
    const int64_t n = hidden.size(0);
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      auto h = hidden.narrow(0, start, len);
      auto y = labels.narrow(0, start, len);
      auto logits = at::matmul(h, weight.t()).to(at::kFloat);
      auto probs = at::softmax(logits, -1);
      const auto valid = y.ne(-100);
      probs.scatter_add_(1, y.clamp_min(0).unsqueeze(1),
                         -valid.to(at::kFloat).unsqueeze(1));  // p - onehot on valid rows
      probs.mul_(valid.to(at::kFloat).unsqueeze(1)).mul_(scale);
      auto d = probs.to(hidden.scalar_type());
      grad_hidden.narrow(0, start, len).copy_(at::matmul(d, weight));
      grad_weight.add_(at::matmul(d.t(), h).to(at::kFloat));
    }
    return {grad_hidden, grad_weight.to(weight.scalar_type()), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

#ifdef ROUNDPIPE_WITH_CUDA
struct FusedLinearCrossEntropy : torch::autograd::Function<FusedLinearCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels, int64_t chunk,
                            double divisor) {
    // Only the gradients autograd will ask for (a frozen lm_head needs none).
    const bool want_hidden = hidden.requires_grad(), want_weight = weight.requires_grad();
    const bool want_grad = want_hidden || want_weight;
    const int64_t n = hidden.size(0), vocab = weight.size(0);
    const auto scale = divisor > 0 ? at::full({}, 1.0 / divisor, hidden.options().dtype(at::kFloat))
                                   : labels.ne(-100).sum().clamp_min(1).to(at::kFloat).reciprocal();
    auto loss_sum = at::zeros({}, hidden.options().dtype(at::kFloat));
    at::Tensor grad_hidden, grad_weight;
    if (want_hidden) grad_hidden = at::empty_like(hidden);
    if (want_weight) grad_weight = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      const auto h = hidden.narrow(0, start, len);
      auto logits = at::mm(h, weight.t());  // becomes the chunk's gradient in place
      ops::check_launch(kernels::cross_entropy(ops::kernel_dtype(logits), logits.data_ptr(),
                                               labels.data_ptr<int64_t>() + start, len, vocab,
                                               scale.data_ptr<float>(), loss_sum.data_ptr<float>(),
                                               want_grad, ops::current_stream()));
      if (want_hidden) {
        auto rows = grad_hidden.narrow(0, start, len);
        at::mm_out(rows, logits, weight);
      }
      // Accumulate the weight's gradient in float32 straight from the
      // low-precision product (cuBLAS with a float32 output). Where the
      // caller asked cuBLAS for fp16 accumulation
      // (torch.backends.cuda.matmul.allow_fp16_accumulation, as the paper's
      // runs on consumer cards do), cuBLAS has no float32 output for half
      // inputs: each chunk's product is then half, as asked, and the chunks
      // add up in float32.
      if (want_weight) {
        if (h.scalar_type() == at::kHalf && at::globalContext().allowFP16AccumulationCuBLAS())
          grad_weight.add_(at::mm(logits.t(), h));
        else
          at::addmm_outf(grad_weight, logits.t(), h, at::kFloat, 1, 1, grad_weight);
      }
    }
    // The weight's gradient is the vocabulary by the hidden size whatever
    // the rows: a chunk of the tail's rows keeps all of it (Note [Tail
    // grain], planner.cpp).
    if (want_weight) note_kept_bytes_independent_of_rows(grad_weight.nbytes());
    ctx->save_for_backward({grad_hidden, grad_weight});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return loss_sum * scale;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto g = grad_out[0].to(at::kFloat);
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    // (The weight's float32 gradient scaled into its dtype by blocks of
    // rows: whole, the float32 product would double it for the moment.)
    return {saved[0].defined() ? saved[0] * g.to(saved[0].scalar_type()) : at::Tensor(),
            saved[1].defined() ? ops::scaled_to(saved[1], g, weight_dtype) : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Logit rows of whole 16-byte packs, contiguous operands.
bool fused_loss_takes(const at::Tensor& hidden, const at::Tensor& weight,
                      const at::Tensor& labels) {
  return ops::fused_available(hidden) && weight.scalar_type() == hidden.scalar_type() &&
         (weight.size(0) * hidden.element_size()) % 16 == 0 && labels.scalar_type() == at::kLong &&
         labels.is_cuda();
}
#endif

}  // namespace

at::Tensor chunked_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                        const at::Tensor& labels, int64_t chunk_tokens,
                                        std::optional<double> divisor) {
  TORCH_CHECK(chunk_tokens > 0, "loss_chunk_tokens must be positive");
  TORCH_CHECK(!divisor || *divisor > 0,
              "the loss divisor (num_items_in_batch) must be positive, got ", *divisor);
  const double d = divisor.value_or(0);  // 0: this call's own token count
  // Without grad mode no gradient will be asked for, but the fused forward
  // makes the gradients as it goes for inputs that require grad (a
  // parameter always does): an evaluation call would build the weight's
  // float32 gradient, vocab x hidden x 4 bytes no plan counts, and drop it.
  if (!c10::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad()))
    return chunked_linear_cross_entropy(hidden.detach(), weight.detach(), labels, chunk_tokens,
                                        divisor);
#ifdef ROUNDPIPE_WITH_CUDA
  if (fused_loss_takes(hidden, weight, labels))
    return FusedLinearCrossEntropy::apply(hidden.contiguous(), weight.contiguous(),
                                          labels.contiguous(), chunk_tokens, d);
#endif
  return ChunkedLinearCrossEntropy::apply(hidden, weight, labels, chunk_tokens, d);
}

}  // namespace roundpipe::models

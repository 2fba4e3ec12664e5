// Chunked linear + cross-entropy: forward and backward one token chunk at a
// time; the logits of a chunk are recomputed in backward.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "roundpipe/models/causal_lm.h"

namespace roundpipe::models {
namespace {

struct ChunkedLinearCrossEntropy : torch::autograd::Function<ChunkedLinearCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels, int64_t chunk) {
    const int64_t n = hidden.size(0);
    const auto valid = labels.ne(-100);
    const double count = std::max<int64_t>(valid.sum().item<int64_t>(), 1);
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
    return {grad_hidden, grad_weight.to(weight.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                        const at::Tensor& labels, int64_t chunk_tokens) {
  TORCH_CHECK(chunk_tokens > 0, "loss_chunk_tokens must be positive");
  return ChunkedLinearCrossEntropy::apply(hidden, weight, labels, chunk_tokens);
}

}  // namespace roundpipe::models

#include "roundpipe/optim/grad_clip.h"

#include <ATen/ops/linalg_vector_norm.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include <cmath>
#include <limits>
#include "optim/adam_kernel.h"
#include "support/parallel.h"

namespace roundpipe::optim {

double global_grad_norm(const std::vector<at::Tensor>& grads) {
  c10::NoGradGuard no_grad;
  // Contiguous CPU gradients: chunks of the vectorised sum of squares on
  // the optimizer's threads, added up in chunk order (the same result on
  // every run). Others: one ATen norm each.
  // (kernel::sum_of_squares rounds within 1.5e-5 of the sum, half that
  // of the norm.)
  constexpr int64_t kChunk = 1 << 16;
  struct Chunk {
    const void* data;
    at::ScalarType type;
    int64_t numel;
  };
  std::vector<Chunk> chunks;
  double squares = 0;
  for (const auto& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    const auto type = g.scalar_type();
    const bool fast = g.device().is_cpu() && g.is_contiguous() &&
                      (type == at::kFloat || type == at::kHalf || type == at::kBFloat16);
    if (!fast) {
      const double n = at::linalg_vector_norm(g, 2, {}, false, at::kFloat).item<double>();
      squares += n * n;
      continue;
    }
    const auto* bytes = static_cast<const char*>(g.data_ptr());
    for (int64_t from = 0; from < g.numel(); from += kChunk)
      chunks.push_back({bytes + from * g.element_size(), type, std::min(kChunk, g.numel() - from)});
  }
  std::vector<double> sums(chunks.size());
  parallel_for_each(static_cast<int64_t>(chunks.size()), [&](int64_t i) {
    const auto& c = chunks[i];
    sums[i] = c.type == at::kFloat
                  ? kernel::sum_of_squares(static_cast<const float*>(c.data), c.numel)
              : c.type == at::kHalf
                  ? kernel::sum_of_squares(static_cast<const c10::Half*>(c.data), c.numel)
                  : kernel::sum_of_squares(static_cast<const c10::BFloat16*>(c.data), c.numel);
  });
  for (double s : sums) squares += s;
  return std::sqrt(squares);
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  // As clip_grad_norm_: the float32 quotient, at most 1. A non-finite norm
  // gives a non-finite coefficient there too (the step then diverges; a
  // GradScaler skips such steps before they get here).
  const float coefficient = static_cast<float>(max_norm) / static_cast<float>(norm + 1e-6);
  return std::isnan(coefficient) ? coefficient : std::min(1.0, static_cast<double>(coefficient));
}

GradClipper::GradClipper(double max_norm) : max_norm_(max_norm) {
  TORCH_CHECK(std::isfinite(max_norm) && max_norm >= 0,
              "GradClipper: max_norm must be a finite number >= 0 (0: measure only), got ",
              max_norm);
}

double GradClipper::clip(const std::vector<at::Tensor>& grads) {
  return clip_norm(global_grad_norm(grads));
}

double GradClipper::clip_norm(double norm) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    norms_.push_back(norm);
  }
  return clip_coefficient(norm, max_norm_);
}

void GradClipper::skipped() {
  std::lock_guard<std::mutex> lock(mu_);
  norms_.push_back(std::numeric_limits<double>::infinity());
}

std::vector<double> GradClipper::norms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return norms_;
}

}  // namespace roundpipe::optim

#include "roundpipe/optim/grad_clip.h"

#include <ATen/ops/linalg_vector_norm.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace roundpipe::optim {

double global_grad_norm(const std::vector<at::Tensor>& grads) {
  c10::NoGradGuard no_grad;
  // Each tensor's norm is one ATen reduction (parallel, float32
  // accumulation); their squares add up in double.
  double squares = 0;
  for (const auto& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    const double n = at::linalg_vector_norm(g, 2, {}, false, at::kFloat).item<double>();
    squares += n * n;
  }
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
  const double norm = global_grad_norm(grads);
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

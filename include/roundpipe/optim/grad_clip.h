// Gradient clipping by global norm for RoundPipe's fused step, with
// torch.nn.utils.clip_grad_norm_'s arithmetic (up to rounding: the squares
// of the per-tensor norms add up in double here, so the coefficient may
// differ from torch's in its last float32 bit):
//
//   norm = || (||g_1||, ..., ||g_n||) ||_2        (each in float32)
//   g_i *= min(1, max_norm / (norm + 1e-6))
//
// The norm is over every gradient of the step: all stages and all
// microbatches (and all calls of an accumulated step), after a GradScaler
// has unscaled them.
//
//   optim::GradClipper clip(1.0);
//   pipe.step(adam, /*is_async=*/true, scaler, &clip);
//   clip.norms();  // of the steps whose update has run, in order
#pragma once

#include <ATen/core/Tensor.h>

#include <mutex>
#include <vector>

namespace roundpipe::optim {

// The L2 norm of all of `grads` together, each tensor's norm taken in
// float32 (as clip_grad_norm_ does for float32 gradients).
double global_grad_norm(const std::vector<at::Tensor>& grads);

// What clip_grad_norm_ multiplies the gradients by for a global norm
// `norm` (1 when max_norm <= 0: no clipping).
double clip_coefficient(double norm, double max_norm);

class GradClipper {
 public:
  // max_norm <= 0 measures the norm and clips nothing.
  explicit GradClipper(double max_norm);

  double max_norm() const { return max_norm_; }
  // On the optimizer thread, once per step: records the global norm of
  // `grads` and returns their clip coefficient (the fused Adam multiplies
  // each gradient by it as it reads it; the gradients stay as they are).
  double clip(const std::vector<at::Tensor>& grads);
  // The same for a global norm computed elsewhere (data parallel with
  // sharded optimizer state: the parts of every process added up).
  double clip_norm(double norm);
  // A step a GradScaler skipped (non-finite gradients): its norm is +inf.
  void skipped();
  // The norm of each step whose update has run so far, in order.
  std::vector<double> norms() const;

 private:
  double max_norm_;
  mutable std::mutex mu_;
  std::vector<double> norms_;
};

}  // namespace roundpipe::optim

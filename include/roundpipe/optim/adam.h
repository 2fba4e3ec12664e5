// A fast Adam/AdamW for CPU tensors: one vectorised, multithreaded pass over
// all parameters at once (AVX-512 / AVX2 / baseline clones chosen at load time
// by the CPU). Numerically it follows torch::optim::Adam (and AdamW with
// decoupled weight decay) operation by operation. With optim_bits = 8 it is
// bitsandbytes' blockwise 8-bit Adam: both moments stored in one byte an
// element, a quarter of the float32 state.
#pragma once

#include <torch/optim/adam.h>

#include <functional>
#include <optional>
#include <vector>

namespace roundpipe::optim {

struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = false;  // true: AdamW
  // 8: both moments in bitsandbytes' blockwise 8-bit format (its Adam8bit:
  // one code a byte, one float32 scale a block of 256) for parameters of at
  // least min_8bit_size elements; smaller ones keep float32 moments, as
  // there. 32: float32 moments.
  int optim_bits = 32;
  int64_t min_8bit_size = 4096;

  AdamConfig& set_lr(double v) {
    lr = v;
    return *this;
  }
  AdamConfig& set_betas(double b1, double b2) {
    beta1 = b1;
    beta2 = b2;
    return *this;
  }
  AdamConfig& set_eps(double v) {
    eps = v;
    return *this;
  }
  AdamConfig& set_weight_decay(double v) {
    weight_decay = v;
    return *this;
  }
  AdamConfig& set_amsgrad(bool v) {
    amsgrad = v;
    return *this;
  }
  AdamConfig& set_maximize(bool v) {
    maximize = v;
    return *this;
  }
  AdamConfig& set_decoupled_weight_decay(bool v) {
    decoupled_weight_decay = v;
    return *this;
  }
  AdamConfig& set_optim_bits(int v) {
    optim_bits = v;
    return *this;
  }
  AdamConfig& set_min_8bit_size(int64_t v) {
    min_8bit_size = v;
    return *this;
  }
};

// The state of a parameter with 8-bit moments: exp_avg and exp_avg_sq hold
// the codes (uint8, the parameter's shape), these the absmax of each block
// of 256 elements (float32, one a block).
struct QuantizedAdamParamState : torch::optim::AdamParamState {
  at::Tensor exp_avg_absmax;
  at::Tensor exp_avg_sq_absmax;
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override {
    return std::make_unique<QuantizedAdamParamState>(*this);
  }
};

// One parameter's share of an Adam update, its state held by the caller.
struct AdamTensors {
  at::Tensor param;                    // updated in place
  at::Tensor grad;                     // same dtype as param, or fp16/bf16 for an fp32 param
  at::Tensor exp_avg;                  // same shape and dtype as param, or 8-bit codes (uint8)
  at::Tensor exp_avg_sq;               // the same
  at::Tensor max_exp_avg_sq;           // amsgrad only
  at::Tensor low_precision_out;        // optional: written with the updated value
  int64_t step = 1;                    // the step number of this update (1 for the first)
  std::optional<double> weight_decay;  // its param group's (default: the config's)
  // The gradient is read times this (gradient clipping's coefficient).
  double grad_multiplier = 1.0;
  // 8-bit moments only: the float32 absmax of each block of 256.
  at::Tensor exp_avg_absmax;
  at::Tensor exp_avg_sq_absmax;
};

// One Adam/AdamW update of every entry with `config`'s hyperparameters, in
// one parallel pass: fp32 contiguous CPU parameters take the vectorised
// kernel, anything else the plain ATen composition (as torch does it).
// Entries whose moments are uint8 take the 8-bit kernel.
void adam_update(const std::vector<AdamTensors>& tensors, const AdamConfig& config);

// A fused optimizer pass (RoundPipe::step(FusedUpdate)): updates each fp32
// master masters[i] from its low-precision gradient grads[i] and writes the
// new value in low precision into outs[i], as Adam::fused_step does.
using FusedUpdate =
    std::function<void(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& outs)>;

// Derives from torch::optim::Adam so that its state (AdamParamState) and
// options serialize with torch::save / torch::load like LibTorch's own Adam.
// `maximize` and `decoupled_weight_decay` are not part of LibTorch's
// AdamOptions; RoundPipe's checkpoints store them beside the state.
class Adam : public torch::optim::Adam {
 public:
  Adam(std::vector<at::Tensor> params, AdamConfig config = {});
  // Param groups (LibTorch's): a group's options may set its own
  // weight_decay (e.g. 0 for norms and biases); the rest is `config`'s.
  Adam(std::vector<torch::optim::OptimizerParamGroup> groups, AdamConfig config);

  // One update of every parameter with a gradient. fp32 contiguous
  // parameters take the fast kernel; others the plain ATen composition.
  at::Tensor step(LossClosure closure = nullptr) override;

  // The fused path for fp32 masters of fp16/bf16 weights: in one pass over
  // memory, reads the low-precision gradient `grads[i]`, updates the moments
  // and `params[i]` (an fp32 master this optimizer owns), and writes the
  // updated value as low precision into `low_precision_out[i]`. Gives the
  // same numbers as: params[i].grad = grads[i].float(); step();
  // low_precision_out[i].copy_(params[i]).
  // `lr`: the learning rate to use (default: the param group's now); an
  // asynchronous step passes the one in effect when it was queued, so that
  // changing it for the next step (a schedule) never races this one.
  // `grad_multiplier`: each gradient is read times it (a GradClipper's
  // coefficient), as if clip_grad_norm_ had scaled it in place.
  void fused_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& low_precision_out,
                  std::optional<double> lr = std::nullopt, double grad_multiplier = 1.0);

  const AdamConfig& config() const { return config_; }
  void set_lr(double lr);
  // The learning rate of the (first) param group.
  double lr() const;

 private:
  AdamConfig config_;
};

}  // namespace roundpipe::optim

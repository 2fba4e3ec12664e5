// Dynamic loss scaling for mixed-precision training with RoundPipe's
// asynchronous optimizer thread.
//
//   loss_fn:  return scaler.scale(loss);            (device threads)
//   step_fn:  scaler.step(optimizer); optimizer.zero_grad();  (optimizer thread)
//   loop:     pipe.step(step_fn); scaler.update();  (caller)
//
// Iteration k scales its loss by the scale after k updates, and step k
// unscales by that same value. update() applies the inf/NaN finding of the
// step before the latest one: a scale change caused by an overflow in step k
// takes effect from iteration k + 2 (one iteration of lag), in async and
// sync mode alike, so the trajectory does not depend on timing;
// update(nullopt, /*is_async=*/false) applies the latest step's finding
// instead (the original's synchronous update).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace roundpipe::optim {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;

  GradScalerOptions& set_init_scale(double v) {
    init_scale = v;
    return *this;
  }
  GradScalerOptions& set_growth_factor(double v) {
    growth_factor = v;
    return *this;
  }
  GradScalerOptions& set_backoff_factor(double v) {
    backoff_factor = v;
    return *this;
  }
  GradScalerOptions& set_growth_interval(int64_t v) {
    growth_interval = v;
    return *this;
  }
  GradScalerOptions& set_enabled(bool v) {
    enabled = v;
    return *this;
  }
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // The loss times the current scale (any device, any thread).
  at::Tensor scale(const at::Tensor& loss) const;
  // Unscales the optimizer's gradients by the scale this step's iteration
  // used, checks them for inf/NaN, and runs optimizer.step() only when all
  // are finite. Returns whether it stepped. Call once per RoundPipe step.
  bool step(torch::optim::Optimizer& optimizer);
  // The same for gradients held elsewhere (RoundPipe's fused Adam path):
  // unscales `grads` in place and runs `update` only when all are finite.
  bool step(const std::vector<at::Tensor>& grads, const std::function<void()>& update);
  // Unscales this step's gradients now (inside the step function, before
  // clipping them); the step's step() then neither unscales them again nor
  // checks them again. Once per step. Returns whether all are finite.
  bool unscale(const std::vector<at::Tensor>& grads);
  // Advances the scale: async (the default), from the finding of the step
  // before the latest one, so the trajectory does not depend on timing;
  // not async, from the latest step's (waiting for it: pair with a
  // synchronous RoundPipe step). `new_scale` replaces the scale instead:
  // not async, at once; async, as the original, from the next update() on
  // (this one advances the scale as usual), so that, like a scale changed
  // by an overflow, it lags one iteration whatever the timing.
  void update(std::optional<double> new_scale = std::nullopt, bool is_async = true);

  double get_scale() const;
  bool is_enabled() const { return options_.enabled; }
  double growth_factor() const;
  double backoff_factor() const;
  int64_t growth_interval() const;
  void set_growth_factor(double v);
  void set_backoff_factor(double v);
  void set_growth_interval(int64_t v);
  int64_t growth_tracker() const;
  // Whether step k found inf/NaN (k counts scaler.step calls from 0).
  bool found_inf(int64_t step) const;

  // State as key/value pairs (scale, growth tracker, counters, options).
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  GradScalerOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<double> scales_;   // scales_[k]: the scale after k updates
  std::vector<bool> found_inf_;  // per completed scaler.step
  int64_t growth_tracker_ = 0;
  int64_t updates_ = 0;
  int64_t applied_ = 0;  // findings of steps before this one have been applied (or skipped)
  std::optional<double> pending_scale_;  // an async update(new_scale), due at the next update()
  // unscale() ran for step `unscaled_step_` (the next step()), finding `unscaled_finite_`.
  int64_t unscaled_step_ = -1;
  bool unscaled_finite_ = true;
};

}  // namespace roundpipe::optim

#include "roundpipe/optim/grad_scaler.h"

#include <ATen/ops/isfinite.h>
#include <ATen/ops/mul.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <chrono>

namespace roundpipe::optim {

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  TORCH_CHECK(options.init_scale > 0, "GradScaler: init_scale must be positive");
  TORCH_CHECK(options.growth_factor > 1, "GradScaler: growth_factor must be above 1");
  TORCH_CHECK(options.backoff_factor > 0 && options.backoff_factor < 1,
              "GradScaler: backoff_factor must lie in (0, 1)");
  TORCH_CHECK(options.growth_interval > 0, "GradScaler: growth_interval must be positive");
  scales_.push_back(options.init_scale);
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled) return loss;
  return at::mul(loss, get_scale());
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  return step(grads, [&] { optimizer.step(); });
}

bool GradScaler::step(const std::vector<at::Tensor>& grads, const std::function<void()>& update) {
  if (!options_.enabled) {
    update();
    return true;
  }
  double scale;
  {
    std::unique_lock<std::mutex> lock(mu_);
    const auto index = static_cast<int64_t>(found_inf_.size());
    TORCH_CHECK(index < static_cast<int64_t>(scales_.size()),
                "GradScaler::step: more steps than iterations; call update() after every "
                "RoundPipe step");
    scale = scales_[index];
  }
  bool finite = true;
  {
    c10::NoGradGuard no_grad;
    const double inverse = 1.0 / scale;
    for (const auto& g : grads) {
      const_cast<at::Tensor&>(g).mul_(inverse);
      finite = finite && at::isfinite(g).all().item<bool>();
    }
  }
  // The finding is known before the update runs: a caller's update() that
  // waits for it need not wait for the optimizer's step as well.
  {
    std::lock_guard<std::mutex> lock(mu_);
    found_inf_.push_back(!finite);
    cv_.notify_all();
  }
  if (finite) update();
  return finite;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  std::unique_lock<std::mutex> lock(mu_);
  const int64_t apply = updates_ - 1;  // the step before the latest one
  if (apply >= 0) {
    const bool done = cv_.wait_for(lock, std::chrono::minutes(10),
                                   [&] { return static_cast<int64_t>(found_inf_.size()) > apply; });
    TORCH_CHECK(done, "GradScaler::update(): step ", apply,
                " never called scaler.step(optimizer); call it once in every step_fn");
    double scale = scales_.back();
    if (found_inf_[apply]) {
      scale *= options_.backoff_factor;
      growth_tracker_ = 0;
    } else if (++growth_tracker_ == options_.growth_interval) {
      scale *= options_.growth_factor;
      growth_tracker_ = 0;
    }
    scales_.push_back(scale);
  } else {
    scales_.push_back(scales_.back());
  }
  ++updates_;
}

double GradScaler::get_scale() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_.enabled ? scales_.back() : 1.0;
}

int64_t GradScaler::growth_tracker() const {
  std::lock_guard<std::mutex> lock(mu_);
  return growth_tracker_;
}

bool GradScaler::found_inf(int64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(step >= 0 && step < static_cast<int64_t>(found_inf_.size()), "GradScaler: step ",
              step, " has not run");
  return found_inf_[step];
}

std::map<std::string, double> GradScaler::state_dict() const {
  std::lock_guard<std::mutex> lock(mu_);
  // Saved between iterations (after update(), all steps done): the scale,
  // the tracker, and the finding the next update() applies.
  const int64_t pending = updates_ - 1;
  return {{"scale", scales_.back()},
          {"growth_tracker", static_cast<double>(growth_tracker_)},
          {"updates", static_cast<double>(updates_)},
          {"pending_found_inf",
           pending >= 0 && pending < static_cast<int64_t>(found_inf_.size()) && found_inf_[pending]
               ? 1.0
               : 0.0},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"enabled", options_.enabled ? 1.0 : 0.0}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  auto get = [&](const char* key) {
    auto it = state.find(key);
    TORCH_CHECK(it != state.end(), "GradScaler::load_state_dict: missing '", key, "'");
    return it->second;
  };
  std::lock_guard<std::mutex> lock(mu_);
  options_.growth_factor = get("growth_factor");
  options_.backoff_factor = get("backoff_factor");
  options_.growth_interval = static_cast<int64_t>(get("growth_interval"));
  options_.enabled = get("enabled") != 0;
  growth_tracker_ = static_cast<int64_t>(get("growth_tracker"));
  updates_ = static_cast<int64_t>(get("updates"));
  // Rebuild the counters so that the next step uses the saved scale and the
  // next update() applies the saved pending finding.
  // Steps 0..updates_-1 have run; the next update() applies the last one's
  // finding, and the next step (index updates_) uses the saved scale.
  scales_.assign(updates_ + 1, get("scale"));
  found_inf_.assign(updates_, false);
  if (updates_ >= 1) found_inf_[updates_ - 1] = get("pending_found_inf") != 0;
}

}  // namespace roundpipe::optim

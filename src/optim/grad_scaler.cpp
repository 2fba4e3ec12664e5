#include "roundpipe/optim/grad_scaler.h"

#include <utility>

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

namespace {
// Multiplies each gradient by `inverse` in place; whether all are finite.
bool unscale_in_place(const std::vector<at::Tensor>& grads, double inverse) {
  c10::NoGradGuard no_grad;
  bool finite = true;
  for (const auto& g : grads) {
    const_cast<at::Tensor&>(g).mul_(inverse);
    finite = finite && at::isfinite(g).all().item<bool>();
  }
  return finite;
}
}  // namespace

bool GradScaler::unscale(const std::vector<at::Tensor>& grads) {
  if (!options_.enabled) return true;
  int64_t index;
  double scale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    index = static_cast<int64_t>(found_inf_.size());
    TORCH_CHECK(unscaled_step_ != index,
                "GradScaler: unscale_() has already been called in this step; call it at most "
                "once per step function, before step()");
    TORCH_CHECK(index < static_cast<int64_t>(scales_.size()),
                "GradScaler: more steps than iterations; call update() after every RoundPipe step");
    scale = scales_[index];
  }
  const bool finite = unscale_in_place(grads, 1.0 / scale);
  std::lock_guard<std::mutex> lock(mu_);
  unscaled_step_ = index;
  unscaled_finite_ = finite;
  return finite;
}

bool GradScaler::step(const std::vector<at::Tensor>& grads, const std::function<void()>& update) {
  if (!options_.enabled) {
    update();
    return true;
  }
  double scale;
  int64_t index;
  bool unscaled;
  {
    std::unique_lock<std::mutex> lock(mu_);
    index = static_cast<int64_t>(found_inf_.size());
    TORCH_CHECK(index < static_cast<int64_t>(scales_.size()),
                "GradScaler::step: more steps than iterations; call update() after every "
                "RoundPipe step");
    scale = scales_[index];
    unscaled = unscaled_step_ == index;
  }
  const bool finite = unscaled ? unscaled_finite_ : unscale_in_place(grads, 1.0 / scale);
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

void GradScaler::update(std::optional<double> new_scale, bool is_async) {
  if (!options_.enabled) return;
  TORCH_CHECK(!new_scale || *new_scale > 0, "GradScaler::update: new_scale must be positive, got ",
              new_scale.value_or(0));
  std::unique_lock<std::mutex> lock(mu_);
  // The finding this update applies: the step before the latest one, or
  // (not async) the latest one, once that step has run.
  const int64_t apply = is_async ? updates_ - 1 : updates_;
  // An earlier async update(new_scale) is due now; an async new one waits
  // for the next update(); a synchronous one applies now.
  const auto due = std::exchange(pending_scale_, std::nullopt);
  if (new_scale && is_async) {
    pending_scale_ = new_scale;
    new_scale = due;
  } else if (!new_scale) {
    new_scale = due;
  }
  if (new_scale) {
    scales_.push_back(*new_scale);
    applied_ = std::max(applied_, apply + 1);  // replaced, not applied later
  } else if (apply >= applied_) {
    const bool done = cv_.wait_for(lock, std::chrono::minutes(10),
                                   [&] { return static_cast<int64_t>(found_inf_.size()) > apply; });
    TORCH_CHECK(done, "GradScaler::update(): step ", apply,
                " never called scaler.step(optimizer); call it once in every step_fn");
    double scale = scales_.back();
    if (found_inf_[apply]) {
      scale *= options_.backoff_factor;
      growth_tracker_ = 0;
    } else if (++growth_tracker_ >= options_.growth_interval) {
      scale *= options_.growth_factor;
      growth_tracker_ = 0;
    }
    scales_.push_back(scale);
    applied_ = apply + 1;
  } else {
    scales_.push_back(scales_.back());  // nothing new to apply
  }
  ++updates_;
}

double GradScaler::growth_factor() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_.growth_factor;
}
double GradScaler::backoff_factor() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_.backoff_factor;
}
int64_t GradScaler::growth_interval() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_.growth_interval;
}
void GradScaler::set_growth_factor(double v) {
  TORCH_CHECK(v > 1, "GradScaler: growth_factor must be above 1, got ", v);
  std::lock_guard<std::mutex> lock(mu_);
  options_.growth_factor = v;
}
void GradScaler::set_backoff_factor(double v) {
  TORCH_CHECK(v > 0 && v < 1, "GradScaler: backoff_factor must lie in (0, 1), got ", v);
  std::lock_guard<std::mutex> lock(mu_);
  options_.backoff_factor = v;
}
void GradScaler::set_growth_interval(int64_t v) {
  TORCH_CHECK(v > 0, "GradScaler: growth_interval must be positive, got ", v);
  std::lock_guard<std::mutex> lock(mu_);
  options_.growth_interval = v;
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
          {"pending_found_inf", pending >= applied_ &&
                                        pending < static_cast<int64_t>(found_inf_.size()) &&
                                        found_inf_[pending]
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
  applied_ = std::max<int64_t>(updates_ - 1, 0);
  unscaled_step_ = -1;
}

}  // namespace roundpipe::optim

#include "roundpipe/optim/adam.h"

#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <tuple>
#include <unordered_map>

#include "optim/adam_kernel.h"
#include "support/parallel.h"

namespace roundpipe::optim {
namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per task: big enough to amortise, small to balance

torch::optim::AdamOptions torch_options(const AdamConfig& c) {
  return torch::optim::AdamOptions(c.lr)
      .betas({c.beta1, c.beta2})
      .eps(c.eps)
      .weight_decay(c.weight_decay)
      .amsgrad(c.amsgrad);
}

// One parameter's share of an update: its tensors and scalars.
struct Work {
  float* param;
  const void* grad;
  at::ScalarType grad_type;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  void* out;  // low-precision copy to write (fused), or null
  int64_t numel;
  kernel::AdamScalars scalars;
};

void run_chunk(const Work& w, int64_t begin, int64_t end) {
  const int64_t n = end - begin;
  float* vmax = w.max_exp_avg_sq ? w.max_exp_avg_sq + begin : nullptr;
  switch (w.grad_type) {
    case at::kFloat:
      kernel::adam_f32(w.param + begin, static_cast<const float*>(w.grad) + begin,
                       w.exp_avg + begin, w.exp_avg_sq + begin, vmax, n, w.scalars);
      break;
    case at::kHalf:
      kernel::adam_f16(w.param + begin, static_cast<const c10::Half*>(w.grad) + begin,
                       w.exp_avg + begin, w.exp_avg_sq + begin, vmax,
                       static_cast<c10::Half*>(w.out) + begin, n, w.scalars);
      break;
    case at::kBFloat16:
      kernel::adam_bf16(w.param + begin, static_cast<const c10::BFloat16*>(w.grad) + begin,
                        w.exp_avg + begin, w.exp_avg_sq + begin, vmax,
                        static_cast<c10::BFloat16*>(w.out) + begin, n, w.scalars);
      break;
    default:
      TORCH_CHECK(false, "roundpipe Adam kernel: unsupported gradient dtype ", w.grad_type);
  }
}

// All chunks of all parameters in one parallel loop.
void run_all(const std::vector<Work>& works) {
  std::vector<std::pair<int, int64_t>> chunks;  // (work, start)
  for (size_t i = 0; i < works.size(); ++i) {
    for (int64_t start = 0; start < works[i].numel; start += kChunk) chunks.emplace_back(i, start);
  }
  parallel_for_each(static_cast<int64_t>(chunks.size()), [&](int64_t c) {
    const auto& w = works[chunks[c].first];
    run_chunk(w, chunks[c].second, std::min(w.numel, chunks[c].second + kChunk));
  });
}

}  // namespace

Adam::Adam(std::vector<at::Tensor> params, AdamConfig config)
    : Adam(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
               std::move(params))},
           config) {}

Adam::Adam(std::vector<torch::optim::OptimizerParamGroup> groups, AdamConfig config)
    : torch::optim::Adam(std::move(groups), torch_options(config)), config_(config) {
  TORCH_CHECK(config.lr >= 0, "Adam: invalid learning rate ", config.lr);
  TORCH_CHECK(config.eps >= 0, "Adam: invalid eps ", config.eps);
  TORCH_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
              "Adam: betas must lie in [0, 1), got (", config.beta1, ", ", config.beta2, ")");
  TORCH_CHECK(config.weight_decay >= 0, "Adam: invalid weight_decay ", config.weight_decay);
}

void Adam::set_lr(double lr) {
  config_.lr = lr;
  for (auto& group : param_groups())
    static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
}

at::Tensor Adam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  std::vector<at::Tensor> params, grads, outs;
  for (auto& group : param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      params.push_back(p);
      grads.push_back(p.grad());
      outs.emplace_back();
    }
  }
  fused_step(params, grads, outs);
  return loss;
}

double Adam::lr() const {
  return static_cast<const torch::optim::AdamOptions&>(param_groups().front().options()).lr();
}

void Adam::fused_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& low_precision_out, std::optional<double> lr,
                      double grad_multiplier) {
  TORCH_CHECK(params.size() == grads.size() && params.size() == low_precision_out.size(),
              "Adam::fused_step: params, grads and outputs differ in count");
  const auto& group_options =
      static_cast<const torch::optim::AdamOptions&>(param_groups().front().options());
  AdamConfig config = config_;
  config.lr = lr.value_or(group_options.lr());
  std::tie(config.beta1, config.beta2) = group_options.betas();
  config.eps = group_options.eps();
  config.weight_decay = group_options.weight_decay();
  config.amsgrad = group_options.amsgrad();
  // Each parameter's group's weight decay (the groups share the rest).
  std::unordered_map<const c10::TensorImpl*, double> group_decay;
  if (param_groups().size() > 1) {
    for (const auto& group : param_groups()) {
      const double wd =
          static_cast<const torch::optim::AdamOptions&>(group.options()).weight_decay();
      for (const auto& p : group.params()) group_decay[p.unsafeGetTensorImpl()] = wd;
    }
  }
  std::vector<AdamTensors> tensors;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    auto key = p.unsafeGetTensorImpl();
    auto it = state_.find(key);
    if (it == state_.end()) {
      auto state = std::make_unique<torch::optim::AdamParamState>();
      state->step(0);
      state->exp_avg(at::zeros_like(p, at::MemoryFormat::Contiguous));
      state->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
      if (config.amsgrad) state->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
      it = state_.emplace(key, std::move(state)).first;
    }
    auto& state = static_cast<torch::optim::AdamParamState&>(*it->second);
    state.step(state.step() + 1);
    tensors.push_back({p, grads[i], state.exp_avg(), state.exp_avg_sq(),
                       config.amsgrad ? state.max_exp_avg_sq() : at::Tensor(), low_precision_out[i],
                       state.step()});
    if (auto d = group_decay.find(key); d != group_decay.end())
      tensors.back().weight_decay = d->second;
    tensors.back().grad_multiplier = grad_multiplier;
  }
  adam_update(tensors, config);
}

void adam_update(const std::vector<AdamTensors>& tensors, const AdamConfig& config) {
  at::NoGradGuard no_grad;
  const double lr = config.lr, beta1 = config.beta1, beta2 = config.beta2, eps = config.eps;
  const bool amsgrad = config.amsgrad;
  std::vector<Work> works;
  for (const auto& t : tensors) {
    const auto& p = t.param;
    const auto& g = t.grad;
    const auto& out = t.low_precision_out;
    const double wd = t.weight_decay.value_or(config.weight_decay);
    TORCH_CHECK(g.sizes() == p.sizes(), "Adam: gradient of shape ", g.sizes(),
                " for a parameter of shape ", p.sizes());
    TORCH_CHECK(
        t.exp_avg.sizes() == p.sizes() && t.exp_avg_sq.sizes() == p.sizes() &&
            (!amsgrad || (t.max_exp_avg_sq.defined() && t.max_exp_avg_sq.sizes() == p.sizes())),
        "Adam: optimizer state of the wrong shape for a parameter of shape ", p.sizes());
    TORCH_CHECK(t.step >= 1, "Adam: step numbers start at 1, got ", t.step);
    const double bc1 = 1 - std::pow(beta1, t.step);
    const double bc2 = 1 - std::pow(beta2, t.step);
    const bool fast =
        p.scalar_type() == at::kFloat && p.is_contiguous() && p.device().is_cpu() &&
        t.exp_avg.scalar_type() == at::kFloat && t.exp_avg_sq.scalar_type() == at::kFloat &&
        t.exp_avg.is_contiguous() && t.exp_avg_sq.is_contiguous() &&
        (!amsgrad ||
         (t.max_exp_avg_sq.is_contiguous() && t.max_exp_avg_sq.scalar_type() == at::kFloat)) &&
        g.is_contiguous() && g.device().is_cpu() &&
        (g.scalar_type() == at::kFloat ||
         (out.defined() && out.scalar_type() == g.scalar_type() && out.is_contiguous())) &&
        (!out.defined() || out.sizes() == p.sizes());
    if (!fast) {
      // The plain ATen composition, as torch::optim::Adam / AdamW do it.
      auto grad = g.to(p.scalar_type());
      if (t.grad_multiplier != 1.0) grad = grad.mul(static_cast<float>(t.grad_multiplier));
      if (config.maximize) grad = -grad;
      if (config.decoupled_weight_decay) {
        p.mul_(1 - lr * wd);
      } else if (wd != 0) {
        grad = grad.add(p, wd);
      }
      t.exp_avg.mul_(beta1).add_(grad, 1 - beta1);
      t.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
      at::Tensor denom;
      if (amsgrad) {
        at::Tensor vmax = t.max_exp_avg_sq;  // a handle on the same storage
        at::maximum_out(vmax, vmax, t.exp_avg_sq);
        denom = (t.max_exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(eps);
      } else {
        denom = (t.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(eps);
      }
      p.addcdiv_(t.exp_avg, denom, -lr / bc1);
      if (out.defined()) out.copy_(p);
      continue;
    }
    Work w;
    w.param = p.data_ptr<float>();
    w.grad = g.data_ptr();
    w.grad_type = g.scalar_type();
    w.exp_avg = t.exp_avg.data_ptr<float>();
    w.exp_avg_sq = t.exp_avg_sq.data_ptr<float>();
    w.max_exp_avg_sq = amsgrad ? t.max_exp_avg_sq.data_ptr<float>() : nullptr;
    w.out = out.defined() ? out.data_ptr() : nullptr;
    w.numel = p.numel();
    auto& s = w.scalars;
    s.beta1 = static_cast<float>(beta1);
    s.one_minus_beta1 = static_cast<float>(1 - beta1);
    s.beta2 = static_cast<float>(beta2);
    s.one_minus_beta2 = static_cast<float>(1 - beta2);
    s.l2_decay = config.decoupled_weight_decay ? 0.f : static_cast<float>(wd);
    s.decoupled_keep = config.decoupled_weight_decay ? static_cast<float>(1 - lr * wd) : 1.f;
    // (The float product, as a gradient clip_grad_norm_ scaled in place.)
    s.grad_sign = static_cast<float>(t.grad_multiplier) * (config.maximize ? -1.f : 1.f);
    s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bc2));
    s.eps = static_cast<float>(eps);
    s.neg_step_size = static_cast<float>(-lr / bc1);
    works.push_back(w);
  }
  run_all(works);
  // A gradient in fp32 with a low-precision output: write it after the pass.
  for (const auto& t : tensors) {
    if (t.low_precision_out.defined() && t.grad.scalar_type() == at::kFloat)
      t.low_precision_out.copy_(t.param);
  }
}

}  // namespace roundpipe::optim

#include "roundpipe/optim/adam.h"

#include <ATen/ops/maximum.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <tuple>
#include <unordered_map>

#include "optim/adam_kernel.h"
#include "optim/dynamic_map.h"
#include "support/parallel.h"

namespace roundpipe::optim {
namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per task: big enough to amortise, small to balance
static_assert(kChunk % kQuantBlock == 0, "an 8-bit chunk must start at a block boundary");

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
  kernel::QuantizedMoments quantized;  // 8-bit moments (exp_avg/exp_avg_sq then null)
  void* out;                           // low-precision copy to write (fused), or null
  int64_t numel;
  kernel::AdamScalars scalars;
};

// An 8-bit chunk starts at a block boundary (kChunk is a multiple of it).
void run_quantized_chunk(const Work& w, int64_t begin, int64_t n) {
  const auto& q = w.quantized;
  const int64_t block = begin / kQuantBlock;
  const kernel::QuantizedMoments at{q.exp_avg + begin, q.exp_avg_absmax + block,
                                    q.exp_avg_sq + begin, q.exp_avg_sq_absmax + block};
  switch (w.grad_type) {
    case at::kFloat:
      kernel::adam8bit_f32(w.param + begin, static_cast<const float*>(w.grad) + begin, at, n,
                           w.scalars);
      break;
    case at::kHalf:
      kernel::adam8bit_f16(w.param + begin, static_cast<const c10::Half*>(w.grad) + begin, at,
                           static_cast<c10::Half*>(w.out) + begin, n, w.scalars);
      break;
    case at::kBFloat16:
      kernel::adam8bit_bf16(w.param + begin, static_cast<const c10::BFloat16*>(w.grad) + begin, at,
                            static_cast<c10::BFloat16*>(w.out) + begin, n, w.scalars);
      break;
    default:
      TORCH_CHECK(false, "roundpipe Adam8bit kernel: unsupported gradient dtype ", w.grad_type);
  }
}

void run_chunk(const Work& w, int64_t begin, int64_t end) {
  const int64_t n = end - begin;
  if (w.quantized.exp_avg) return run_quantized_chunk(w, begin, n);
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
  TORCH_CHECK(config.optim_bits == 32 || config.optim_bits == 8,
              "Adam: optim_bits must be 32 (float32 moments) or 8 (blockwise 8-bit moments), got ",
              config.optim_bits);
  TORCH_CHECK(config.optim_bits == 32 || !config.amsgrad,
              "Adam: 8-bit optimizer state has no amsgrad variant (as in bitsandbytes); set "
              "amsgrad=false or optim_bits=32");
  TORCH_CHECK(config.min_8bit_size >= 0, "Adam: invalid min_8bit_size ", config.min_8bit_size);
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

namespace {

// A new parameter's state: float32 moments, or 8-bit ones where the config
// asks for them and the parameter is large enough (bitsandbytes' rule).
std::unique_ptr<torch::optim::AdamParamState> new_state(const at::Tensor& p,
                                                        const AdamConfig& config) {
  std::unique_ptr<torch::optim::AdamParamState> state;
  if (config.optim_bits == 8 && p.numel() >= config.min_8bit_size) {
    auto quantized = std::make_unique<QuantizedAdamParamState>();
    const auto codes = p.options().dtype(at::kByte);
    const int64_t blocks = (p.numel() + kQuantBlock - 1) / kQuantBlock;
    // Codes 0 under an absmax of 0: moments of zero.
    quantized->exp_avg(at::zeros(p.sizes(), codes));
    quantized->exp_avg_sq(at::zeros(p.sizes(), codes));
    quantized->exp_avg_absmax = at::zeros({blocks}, p.options().dtype(at::kFloat));
    quantized->exp_avg_sq_absmax = at::zeros({blocks}, p.options().dtype(at::kFloat));
    state = std::move(quantized);
  } else {
    state = std::make_unique<torch::optim::AdamParamState>();
    state->exp_avg(at::zeros_like(p, at::MemoryFormat::Contiguous));
    state->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
    if (config.amsgrad) state->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
  }
  state->step(0);
  return state;
}

}  // namespace

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
    if (it == state_.end()) it = state_.emplace(key, new_state(p, config)).first;
    auto& state = static_cast<torch::optim::AdamParamState&>(*it->second);
    state.step(state.step() + 1);
    tensors.push_back({p, grads[i], state.exp_avg(), state.exp_avg_sq(),
                       config.amsgrad ? state.max_exp_avg_sq() : at::Tensor(), low_precision_out[i],
                       state.step()});
    if (auto d = group_decay.find(key); d != group_decay.end())
      tensors.back().weight_decay = d->second;
    tensors.back().grad_multiplier = grad_multiplier;
    if (const auto* q = dynamic_cast<const QuantizedAdamParamState*>(&state)) {
      tensors.back().exp_avg_absmax = q->exp_avg_absmax;
      tensors.back().exp_avg_sq_absmax = q->exp_avg_sq_absmax;
    }
  }
  adam_update(tensors, config);
}

namespace {

// The kernel's scalars of one entry (torch's arithmetic, as floats).
kernel::AdamScalars scalars_of(const AdamTensors& t, const AdamConfig& config) {
  const double lr = config.lr, wd = t.weight_decay.value_or(config.weight_decay);
  const double bc1 = 1 - std::pow(config.beta1, t.step);
  const double bc2 = 1 - std::pow(config.beta2, t.step);
  kernel::AdamScalars s;
  s.beta1 = static_cast<float>(config.beta1);
  s.one_minus_beta1 = static_cast<float>(1 - config.beta1);
  s.beta2 = static_cast<float>(config.beta2);
  s.one_minus_beta2 = static_cast<float>(1 - config.beta2);
  s.l2_decay = config.decoupled_weight_decay ? 0.f : static_cast<float>(wd);
  s.decoupled_keep = config.decoupled_weight_decay ? static_cast<float>(1 - lr * wd) : 1.f;
  // (The float product, as a gradient clip_grad_norm_ scaled in place.)
  s.grad_sign = static_cast<float>(t.grad_multiplier) * (config.maximize ? -1.f : 1.f);
  s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(config.eps);
  s.neg_step_size = static_cast<float>(-lr / bc1);
  return s;
}

bool is_low_precision(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16;
}

// The plain ATen composition, as torch::optim::Adam / AdamW do it.
void composed_update(const AdamTensors& t, const AdamConfig& config) {
  const double lr = config.lr, wd = t.weight_decay.value_or(config.weight_decay);
  const double bc1 = 1 - std::pow(config.beta1, t.step);
  const double bc2 = 1 - std::pow(config.beta2, t.step);
  const auto& p = t.param;
  auto grad = t.grad.to(p.scalar_type());
  if (t.grad_multiplier != 1.0) grad = grad.mul(static_cast<float>(t.grad_multiplier));
  if (config.maximize) grad = -grad;
  if (config.decoupled_weight_decay) {
    p.mul_(1 - lr * wd);
  } else if (wd != 0) {
    grad = grad.add(p, wd);
  }
  t.exp_avg.mul_(config.beta1).add_(grad, 1 - config.beta1);
  t.exp_avg_sq.mul_(config.beta2).addcmul_(grad, grad, 1 - config.beta2);
  at::Tensor denom;
  if (config.amsgrad) {
    at::Tensor vmax = t.max_exp_avg_sq;  // a handle on the same storage
    at::maximum_out(vmax, vmax, t.exp_avg_sq);
    denom = (t.max_exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(config.eps);
  } else {
    denom = (t.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(config.eps);
  }
  p.addcdiv_(t.exp_avg, denom, -lr / bc1);
  if (t.low_precision_out.defined()) t.low_precision_out.copy_(p);
}

// What the 8-bit kernel needs of an entry, checked. A parameter that is not
// float32 is updated through a float32 copy (`float_param`), written back
// after the pass, as bitsandbytes updates fp16/bf16 parameters.
Work quantized_work(const AdamTensors& t, const AdamConfig& config, at::Tensor& float_param,
                    at::Tensor& float_grad) {
  const auto& p = t.param;
  const int64_t blocks = (p.numel() + kQuantBlock - 1) / kQuantBlock;
  TORCH_CHECK(!config.amsgrad,
              "Adam: 8-bit optimizer state has no amsgrad variant (as in bitsandbytes); set "
              "amsgrad=false or use float32 state");
  TORCH_CHECK(p.device().is_cpu() && t.grad.device().is_cpu(),
              "Adam: 8-bit state updates CPU tensors");
  for (const auto* s : {&t.exp_avg, &t.exp_avg_sq}) {
    TORCH_CHECK(s->scalar_type() == at::kByte && s->is_contiguous() && s->numel() == p.numel(),
                "Adam: 8-bit moments must be contiguous uint8 of the parameter's size ", p.numel());
  }
  for (const auto* a : {&t.exp_avg_absmax, &t.exp_avg_sq_absmax}) {
    TORCH_CHECK(a->defined() && a->scalar_type() == at::kFloat && a->is_contiguous() &&
                    a->numel() == blocks,
                "Adam: 8-bit moments need float32 absmax tensors of ", blocks,
                " blocks (one per 256 elements)");
  }
  const bool float32 = p.scalar_type() == at::kFloat && p.is_contiguous();
  float_param = float32 ? p : p.to(at::kFloat).contiguous();
  const auto& out = t.low_precision_out;
  const bool fused_out = out.defined() && out.scalar_type() == t.grad.scalar_type() &&
                         out.is_contiguous() && out.sizes() == p.sizes() &&
                         is_low_precision(out.scalar_type()) && t.grad.is_contiguous();
  float_grad = fused_out || (t.grad.scalar_type() == at::kFloat && t.grad.is_contiguous())
                   ? t.grad
                   : t.grad.to(at::kFloat).contiguous();
  Work w{};
  w.param = float_param.data_ptr<float>();
  w.grad = float_grad.data_ptr();
  w.grad_type = float_grad.scalar_type();
  w.quantized = {t.exp_avg.data_ptr<uint8_t>(), t.exp_avg_absmax.data_ptr<float>(),
                 t.exp_avg_sq.data_ptr<uint8_t>(), t.exp_avg_sq_absmax.data_ptr<float>()};
  w.out = fused_out ? out.data_ptr() : nullptr;
  w.numel = p.numel();
  w.scalars = scalars_of(t, config);
  return w;
}

}  // namespace

void adam_update(const std::vector<AdamTensors>& tensors, const AdamConfig& config) {
  at::NoGradGuard no_grad;
  const bool amsgrad = config.amsgrad;
  std::vector<Work> works;
  // Per entry: a float32 copy of a parameter that is not float32 (8-bit
  // state only), and the gradient as the kernel reads it.
  std::vector<at::Tensor> float_params(tensors.size()), kernel_grads(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const auto& p = t.param;
    const auto& g = t.grad;
    const auto& out = t.low_precision_out;
    TORCH_CHECK(g.sizes() == p.sizes(), "Adam: gradient of shape ", g.sizes(),
                " for a parameter of shape ", p.sizes());
    TORCH_CHECK(t.step >= 1, "Adam: step numbers start at 1, got ", t.step);
    if (t.exp_avg.scalar_type() == at::kByte) {
      works.push_back(quantized_work(t, config, float_params[i], kernel_grads[i]));
      continue;
    }
    TORCH_CHECK(
        t.exp_avg.sizes() == p.sizes() && t.exp_avg_sq.sizes() == p.sizes() &&
            (!amsgrad || (t.max_exp_avg_sq.defined() && t.max_exp_avg_sq.sizes() == p.sizes())),
        "Adam: optimizer state of the wrong shape for a parameter of shape ", p.sizes());
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
      composed_update(t, config);
      continue;
    }
    Work w{};
    w.param = p.data_ptr<float>();
    w.grad = g.data_ptr();
    w.grad_type = g.scalar_type();
    w.exp_avg = t.exp_avg.data_ptr<float>();
    w.exp_avg_sq = t.exp_avg_sq.data_ptr<float>();
    w.max_exp_avg_sq = amsgrad ? t.max_exp_avg_sq.data_ptr<float>() : nullptr;
    w.out = out.defined() ? out.data_ptr() : nullptr;
    w.numel = p.numel();
    w.scalars = scalars_of(t, config);
    works.push_back(w);
  }
  run_all(works);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const bool via_copy = float_params[i].defined() && !float_params[i].is_same(t.param);
    if (via_copy) t.param.copy_(float_params[i]);
    // A low-precision output the pass did not write: copy it after.
    const bool written = kernel_grads[i].defined() ? is_low_precision(kernel_grads[i].scalar_type())
                                                   : is_low_precision(t.grad.scalar_type());
    if (t.low_precision_out.defined() && !written) t.low_precision_out.copy_(t.param);
  }
}

}  // namespace roundpipe::optim

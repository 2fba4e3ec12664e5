// Rotary position embeddings: see rope.h.
#include "models/rope.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace roundpipe::models::detail {

at::Tensor inverse_frequencies(const CausalLMConfig& c) {
  const int64_t dim = c.head_dim;
  auto inv = 1.0 / at::pow(c.rope_theta, at::arange(0, dim, 2, at::kLong).to(at::kFloat) / dim);
  if (c.rope_scaling.type == "yarn") {
    // Interpolated (inv / factor) below the ramp, extrapolated (inv) above,
    // linear in between; the ramp's ends are the dimensions that turn
    // beta_fast and beta_slow times over the original context.
    const auto& r = c.rope_scaling;
    const double base = c.rope_theta, len = static_cast<double>(r.original_max_position_embeddings);
    auto dim_of = [&](double rotations) {
      return dim * std::log(len / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = dim_of(r.beta_fast), high = dim_of(r.beta_slow);
    if (r.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    const auto ramp = ((at::arange(dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
    const auto extrapolated = 1 - ramp;
    return inv / r.factor * (1 - extrapolated) + inv * extrapolated;
  }
  if (c.rope_scaling.type != "llama3") return inv;
  const auto& r = c.rope_scaling;
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_wavelen = old_len / r.low_freq_factor;
  const double high_wavelen = old_len / r.high_freq_factor;
  auto wavelen = 2 * M_PI / inv;
  auto scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
  auto smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  auto smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  auto medium = (wavelen < high_wavelen).logical_not() * (wavelen > low_wavelen).logical_not();
  return at::where(medium, smoothed, scaled);
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& positions,
                                                const at::Tensor& inv_freq,
                                                const RopeScaling& scaling, c10::ScalarType dtype) {
  auto freqs = positions.unsqueeze(-1) * inv_freq;  // [rows, T, head_dim / 2]
  auto emb = at::cat({freqs, freqs}, -1);           // [rows, T, head_dim]
  auto cos = emb.cos(), sin = emb.sin();
  if (scaling.type == "yarn") {  // (yarn's attention factor)
    cos = cos * scaling.attention_factor;
    sin = sin * scaling.attention_factor;
  }
  return {cos.to(dtype), sin.to(dtype)};
}

}  // namespace roundpipe::models::detail

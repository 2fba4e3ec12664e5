// The presets' dense MLP (SwiGLU: down(silu(gate(x)) * up(x))), token
// chunk by token chunk above `chunk_tokens` (TokenChunkedMLP). Internal
// header (its one user: decoder_layer.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/cloneable.h>

#include <algorithm>
#include <vector>

#include "models/modules.h"
#include "roundpipe/models/config.h"
#include "roundpipe/models/fused_ops.h"
#include "roundpipe/recompute.h"

namespace roundpipe::models::detail {

// The MLP of a long sequence, token chunk by token chunk: forward keeps only
// its input; backward recomputes one chunk's [chunk, intermediate]
// activations at a time, so the MLP's activation memory is bounded by the
// chunk, not the sequence (the rest of a layer is linear in the sequence).
struct TokenChunkedMLP : torch::autograd::Function<TokenChunkedMLP> {
  // down(swiglu(gate(x), up(x))); an absent bias is an empty tensor (custom
  // functions take no undefined inputs).
  static at::Tensor body(const at::Tensor& x, const std::vector<at::Tensor>& p) {
    auto bias = [&](int i) { return p[i].numel() > 0 ? p[i] : at::Tensor(); };
    return at::linear(ops::swiglu(at::linear(x, p[0], bias(1)), at::linear(x, p[2], bias(3))), p[4],
                      bias(5));
  }
  static at::Tensor no_bias_if_absent(const at::Tensor& b) {
    return b.defined() ? b : at::empty({0});
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& gate_w, const at::Tensor& gate_b,
                            const at::Tensor& up_w, const at::Tensor& up_b,
                            const at::Tensor& down_w, const at::Tensor& down_b, int64_t chunk) {
    const std::vector<at::Tensor> p = {gate_w, gate_b, up_w, up_b, down_w, down_b};
    const auto flat = x.reshape({-1, x.size(-1)});
    auto out = at::empty({flat.size(0), down_w.size(0)}, x.options());
    for (int64_t start = 0; start < flat.size(0); start += chunk) {
      const int64_t len = std::min(chunk, flat.size(0) - start);
      out.narrow(0, start, len).copy_(body(flat.narrow(0, start, len), p));
    }
    ctx->save_for_backward({x, gate_w, gate_b, up_w, up_b, down_w, down_b});
    ctx->saved_data["chunk"] = chunk;
    auto sizes = x.sizes().vec();
    sizes.back() = down_w.size(0);
    return out.view(sizes);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const auto flat = saved[0].reshape({-1, saved[0].size(-1)});
    const auto grad = grads[0].reshape({flat.size(0), -1});
    auto grad_x = at::empty_like(flat);
    // Parameter gradients add up over chunks in float32 (or wider).
    // Leaves for the parameters autograd wants gradients of (frozen ones
    // and absent biases stay plain tensors).
    std::vector<at::Tensor> params, sums(6);
    for (int i = 1; i <= 6; ++i) {
      const bool wanted = saved[i].numel() > 0 && ctx->needs_input_grad(i);
      params.push_back(wanted ? saved[i].detach().requires_grad_() : saved[i].detach());
    }
    for (int64_t start = 0; start < flat.size(0); start += chunk) {
      const int64_t len = std::min(chunk, flat.size(0) - start);
      c10::AutoGradMode grad_mode(true);
      auto x = flat.narrow(0, start, len).detach().requires_grad_();
      std::vector<at::Tensor> inputs = {x};
      for (const auto& t : params)
        if (t.requires_grad()) inputs.push_back(t);
      const auto g = torch::autograd::grad({body(x, params)}, inputs, {grad.narrow(0, start, len)});
      grad_x.narrow(0, start, len).copy_(g[0]);
      size_t k = 1;
      for (int i = 0; i < 6; ++i) {
        if (!params[i].requires_grad()) continue;
        sums[i] = sums[i].defined() ? sums[i].add_(g[k])
                                    : g[k].to(at::promote_types(g[k].scalar_type(), at::kFloat));
        ++k;
      }
    }
    torch::autograd::variable_list out = {grad_x.view(saved[0].sizes())};
    for (int i = 0; i < 6; ++i)
      out.push_back(sums[i].defined() ? sums[i].to(saved[i + 1].scalar_type()) : at::Tensor());
    out.push_back(at::Tensor());  // chunk
    return out;
  }
};

struct MLPImpl : torch::nn::Cloneable<MLPImpl> {
  CausalLMConfig config;
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  int64_t chunk_tokens = 0;  // > 0: longer inputs go by TokenChunkedMLP
  LoraOptions lora;
  std::optional<BaseQuantization> quant;  // the projections' base weights quantized
  MLPImpl(CausalLMConfig c, LoraOptions l, std::optional<BaseQuantization> q = std::nullopt)
      : config(std::move(c)), lora(std::move(l)), quant(q) {
    reset();
  }
  void reset() override {
    const auto& c = config;
    gate_proj = register_module("gate_proj", make_linear(c.hidden_size, c.intermediate_size,
                                                         c.mlp_bias, lora, "gate_proj", quant));
    up_proj = register_module("up_proj", make_linear(c.hidden_size, c.intermediate_size, c.mlp_bias,
                                                     lora, "up_proj", quant));
    down_proj = register_module("down_proj", make_linear(c.intermediate_size, c.hidden_size,
                                                         c.mlp_bias, lora, "down_proj", quant));
  }
  at::Tensor forward(const at::Tensor& x) {
    // With or without grad: without, the function keeps nothing and its
    // chunks alone bound the intermediates.
    // (A chunk of a microbatch's rows as the whole microbatch: row_chunk_scale().)
    const auto tokens = static_cast<double>(x.numel() / x.size(-1)) * row_chunk_scale();
    if (chunk_tokens > 0 && tokens > static_cast<double>(chunk_tokens))
      return TokenChunkedMLP::apply(
          x, gate_proj->base_weight(x.scalar_type()),
          TokenChunkedMLP::no_bias_if_absent(gate_proj->bias),
          up_proj->base_weight(x.scalar_type()), TokenChunkedMLP::no_bias_if_absent(up_proj->bias),
          down_proj->base_weight(x.scalar_type()),
          TokenChunkedMLP::no_bias_if_absent(down_proj->bias), chunk_tokens);
    return down_proj(ops::swiglu(gate_proj(x), up_proj(x)));
  }
};
TORCH_MODULE(MLP);

}  // namespace roundpipe::models::detail

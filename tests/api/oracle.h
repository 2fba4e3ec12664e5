// The engine's oracle: the same model trained with plain LibTorch on one
// device, microbatch by microbatch, with the documented random streams
// (rng.h). Shared by the engine's tests.
#pragma once

#include <ATen/CPUGeneratorImpl.h>

#include "runtime/values/rng.h"
#include "test_util.h"

namespace roundpipe::testing {

inline constexpr double kTol = 1e-5;

inline uint64_t draw_call_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}

// The oracle: plain LibTorch, one device, microbatch m seeded per rng.h.
inline std::vector<at::Tensor> oracle_microbatches(torch::nn::Sequential& model,
                                                   const at::Tensor& x, int n, uint64_t call_seed,
                                                   c10::Device device) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::vector<at::Tensor> outs;
  const auto xs = microbatches_of(x, n);
  for (int m = 0; m < n; ++m) {
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(microbatch_seed(call_seed, m));
    }
    outs.push_back(model->forward(xs[m]));
  }
  return outs;
}

inline void expect_same_state(torch::nn::Sequential& ours, torch::nn::Sequential& oracle,
                              bool grads) {
  auto p = ours->parameters(), q = oracle->parameters();
  ASSERT_EQ(p.size(), q.size());
  for (size_t i = 0; i < p.size(); ++i) {
    if (!grads) continue;
    EXPECT_TENSOR_NEAR(p[i].grad(), q[i].grad(), kTol, "gradient of parameter " << i);
  }
  auto b = ours->buffers(), c = oracle->buffers();
  ASSERT_EQ(b.size(), c.size());
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_TENSOR_NEAR(b[i].to(at::kDouble), c[i].to(at::kDouble), kTol, "buffer " << i);
  }
}

}  // namespace roundpipe::testing

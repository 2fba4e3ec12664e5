// Long microbatches on a small device: calls of one microbatch (Note [One
// microbatch a call]) and chunks of the tail's rows of microbatches whose
// MLP runs token chunk by token chunk (Note [Tail row chunks of a
// token-chunked layer]), against plain LibTorch.
#include <roundpipe/models/causal_lm.h>

#include "api/oracle.h"

namespace roundpipe::testing {
namespace {

// A Qwen3-shaped model whose MLP runs token chunk by token chunk above
// 1,024 tokens (as 1.7B's above 16,384).
models::CausalLM small_qwen3() {
  torch::manual_seed(5);
  const std::string json = R"({"model_type":"qwen3","vocab_size":1024,"hidden_size":128,
      "intermediate_size":384,"num_hidden_layers":6,"num_attention_heads":4,
      "num_key_value_heads":2,"head_dim":32,"tie_word_embeddings":true})";
  return models::CausalLM(models::CausalLMConfig::from_json_string(json, "config.json"),
                          models::CausalLMOptions().set_mlp_chunk_tokens(1024));
}

models::CausalLMInput tokens(int64_t rows, int64_t seq) {
  models::CausalLMInput in;
  in.input_ids = at::randint(0, 1024, {rows, seq}, at::detail::createCPUGenerator(6));
  in.labels = in.input_ids.clone();
  in.attention_mask = at::ones({rows, seq}, at::kLong);
  return in;
}

// `calls` calls of `n` microbatches on `pipe` (no step: the gradients add
// up), each loss against the oracle's; the oracle's gradients made alike.
void train_against_oracle(RoundPipe& pipe, models::CausalLM& oracle,
                          const models::CausalLMInput& in, int n, int calls,
                          const std::function<void(int)>& before_call = nullptr) {
  const LossFn loss_of = [n](const c10::IValue& out, const c10::IValue&) {
    return out.toTensor() / n;  // (each microbatch's mean: the same rows each)
  };
  at::Tensor expected;
  {
    const auto rows = in.input_ids.size(0);
    for (int m = 0; m < n; ++m) {
      auto part = in;
      part.input_ids = in.input_ids.narrow(0, m * rows / n, rows / n);
      part.labels = in.labels.narrow(0, m * rows / n, rows / n);
      part.attention_mask = in.attention_mask.narrow(0, m * rows / n, rows / n);
      const auto loss = oracle.sequential()->forward<c10::IValue>(part.to_ivalue()).toTensor() / n;
      expected = expected.defined() ? expected + loss : loss;
    }
  }
  for (int call = 0; call < calls; ++call) {
    if (before_call) before_call(call);
    const auto loss = pipe.forward_backward(in.to_ivalue(), c10::IValue(), loss_of, false,
                                            RunConfig().set_num_microbatch(n))
                          .loss;
    pipe.synchronize();
    EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
  }
  (expected * calls).backward();
}

// Four calls of `in` in `n` microbatches on a simulated device of
// `budget_mib`, against plain LibTorch (each loss, then the gradients),
// none running out of memory: the plan the calls run, its limit, and the
// device's peak over the last two calls (planned on what the first two
// measured).
struct PlannedCalls {
  PlanEstimate plan;
  int64_t limit = 0;  // the plan's: 90% of the budget
  int64_t peak = 0;
  PipelineStats stats;
};
PlannedCalls train_on_budget(int64_t budget_mib, const models::CausalLMInput& in, int n) {
  auto model = small_qwen3(), oracle = small_qwen3();
  const int64_t budget = budget_mib << 20;
  RoundPipe pipe(model.sequential(),
                 RoundPipeOptions().set_devices("sim:1,mem=" + std::to_string(budget)));
  train_against_oracle(pipe, oracle, in, n, /*calls=*/4, [&](int call) {
    if (call == 2) pipe.devices().at(0)->reset_peak_memory();
  });
  expect_same_state(model.sequential(), oracle.sequential(), /*grads=*/true);
  PlannedCalls calls{pipe.auto_plan(true, n, 0, std::nullopt, in.input_ids.size(0) / n),
                     static_cast<int64_t>(static_cast<double>(budget) * 0.9),
                     pipe.devices().at(0)->memory_stats().peak_bytes, pipe.pipeline_stats()};
  EXPECT_EQ(calls.stats.out_of_memory_recoveries, 0);
  // The latest call reports the plan it ran, made within the limit.
  EXPECT_GT(calls.stats.last_call_planned_peak_bytes, 0);
  EXPECT_LE(calls.stats.last_call_planned_peak_bytes, calls.limit);
  return calls;
}

// One row of 4,096 tokens, a call a microbatch, on a simulated device of
// 80 MiB: one decoder layer keeps ~30 MiB for its backward there, more
// than half of the plan's limit (90% of the budget) holds, so no plan that
// holds half back exists (the calls used to fail with "model_memory_limit
// ... too small" from the third on), while the calls peak at ~62 MiB. They
// train, without running out of memory, to plain LibTorch's loss and
// gradients, on a plan within the limit, not half of it.
TEST(LongMicrobatches, OneMicrobatchACallTrainsWhereNoPlanHoldsHalfTheLimitBack) {
  const auto calls = train_on_budget(80, tokens(1, 4096), /*n=*/1);
  // (Training at all is the check: from the third call on, the plan threw.
  // Its estimate exceeds half the limit, as a half-held plan's now may too.)
  EXPECT_LE(calls.plan.largest_peak_bytes(), calls.limit) << calls.plan.describe();
}

// The same row at 128 MiB, where a plan holding half the limit back
// exists and is taken (as before Note [One microbatch a call]): its
// stages' estimate counts the backwards that allocated the gradients. It
// counted the forward's working memory alone and fell 9 MB short of the
// peak here (on an H100 by 1.65-4.63 GiB for one row of 65,536 or 131,072
// tokens). What it still leaves to the tenth of the budget held back: the
// tail's input, the row's hidden state (2 MiB in float32) and its mask
// (32 KiB of int64), which the tail holds on the device through the
// microbatch so that a retry can run it again.
TEST(LongMicrobatches, OneMicrobatchACallEstimateBoundsItsPeakWhereHalfIsHeldBack) {
  const auto calls = train_on_budget(128, tokens(1, 4096), /*n=*/1);
  // With as much again of slack: the simulated device also charges the CPU
  // kernels' scratch memory, which differs with the CPU and its threads
  // (here the peak was within 4 KB of the estimate and the input; the
  // estimate without the backwards measured fell 9 MB short).
  const int64_t tail_input = int64_t{4096} * 128 * 4 + int64_t{4096} * 8;
  EXPECT_LE(calls.peak, calls.plan.largest_peak_bytes() + 2 * tail_input) << calls.plan.describe();
}

// 8 x 512 tokens in 2 microbatches of 2,048 tokens (the MLP token-chunked)
// on a simulated device of 96 MiB, where the fused tail runs them in
// chunks of rows below 1,024 tokens: the chunks keep their share of what
// the whole microbatches were measured to keep, so the measured plans'
// estimate bounds what the device holds (it fell 40 MB short, and a call
// ran out of memory, while the chunks' MLP kept its intermediates).
TEST(LongMicrobatches, ChunksOfRowsOfATokenChunkedMicrobatchKeepTheirShare) {
  const auto calls = train_on_budget(96, tokens(8, 512), /*n=*/2);
  EXPECT_GT(calls.stats.tail_microbatches_in_row_chunks, 0);
  EXPECT_LE(calls.peak, calls.plan.largest_peak_bytes()) << calls.plan.describe();
}

}  // namespace
}  // namespace roundpipe::testing

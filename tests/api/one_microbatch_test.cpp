// Calls of one microbatch (one long row), Note [One microbatch a call]:
// they measure the backward's working memory on backwards that allocate
// the gradients, and train where no plan holds half the limit back.
#include <roundpipe/models/causal_lm.h>

#include "api/oracle.h"

namespace roundpipe::testing {
namespace {

// A Qwen3-shaped model (the MLP token-chunked above 1,024 tokens, as
// 1.7B's above 16,384) over one row of 4,096 tokens, a call a microbatch,
// on a simulated device of 80 MiB: one decoder layer keeps ~30 MiB for its
// backward there, more than half of the plan's limit (90% of the budget)
// holds, so no plan that holds half back exists (the calls used to fail
// with "model_memory_limit ... too small" from the third on), while the
// calls peak at ~62 MiB. They train, without running out of memory, to
// plain LibTorch's loss and gradients.
TEST(OneMicrobatchACall, TrainsWhereNoPlanHoldsHalfTheLimitBack) {
  const std::string json = R"({"model_type":"qwen3","vocab_size":1024,"hidden_size":128,
      "intermediate_size":384,"num_hidden_layers":6,"num_attention_heads":4,
      "num_key_value_heads":2,"head_dim":32,"tie_word_embeddings":true})";
  const auto make = [&] {
    torch::manual_seed(5);
    return models::CausalLM(models::CausalLMConfig::from_json_string(json, "config.json"),
                            models::CausalLMOptions().set_mlp_chunk_tokens(1024));
  };
  auto model = make(), oracle = make();
  const int64_t budget = int64_t{80} << 20;
  RoundPipe pipe(model.sequential(),
                 RoundPipeOptions().set_devices("sim:1,mem=" + std::to_string(budget)));
  models::CausalLMInput in;
  in.input_ids = at::randint(0, 1024, {1, 4096}, at::detail::createCPUGenerator(6));
  in.labels = in.input_ids.clone();
  in.attention_mask = at::ones({1, 4096}, at::kLong);
  const LossFn loss_of = [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); };
  const auto expected = oracle.sequential()->forward<c10::IValue>(in.to_ivalue()).toTensor();
  const int calls = 4;
  for (int call = 0; call < calls; ++call) {
    const auto loss = pipe.forward_backward(in.to_ivalue(), c10::IValue(), loss_of, false,
                                            RunConfig().set_num_microbatch(1))
                          .loss;
    pipe.synchronize();
    EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
  }
  (expected * calls).backward();  // (no step: the gradients add up over the calls)
  expect_same_state(model.sequential(), oracle.sequential(), /*grads=*/true);
  EXPECT_EQ(pipe.pipeline_stats().out_of_memory_recoveries, 0);
  EXPECT_LE(pipe.devices().at(0)->memory_stats().peak_bytes, budget);
  // The plan of such calls stands on the measured working memory: within
  // the limit, not half of it.
  const auto plan = pipe.auto_plan(true, 1, 0, std::nullopt, 1);
  const auto limit = static_cast<int64_t>(budget * 0.9);
  int64_t predicted = 0;
  for (const auto& stage : plan.stages) predicted = std::max(predicted, stage.peak_bytes);
  EXPECT_GT(predicted, limit / 2) << plan.describe();
  EXPECT_LE(predicted, limit) << plan.describe();
}

}  // namespace
}  // namespace roundpipe::testing

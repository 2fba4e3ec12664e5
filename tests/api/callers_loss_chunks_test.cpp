// Note [A caller's loss over row chunks]: a model whose last layer gives a
// 0-dim loss (as the presets' does), trained with a loss function of the
// caller's under a budget that holds only some of the tail's activations:
// a linear function runs the tail in checked chunks of rows, a square keeps
// whole microbatches; either way the results are plain LibTorch's on whole
// microbatches, and the function's value is reported once per microbatch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>

#include "api/oracle.h"
#include "roundpipe/layer.h"
#include "roundpipe/roundpipe.h"

namespace roundpipe::testing {
namespace {

constexpr int kLayers = 8, kMicrobatches = 2, kRows = 1024;

// (h, target) rows in, the same rows out: h through a small MLP.
struct RowPairImpl : torch::nn::Cloneable<RowPairImpl>, SplitsInputRows {
  torch::nn::Linear up{nullptr}, down{nullptr};
  RowPairImpl() { reset(); }
  void reset() override {
    up = register_module("up", torch::nn::Linear(4, 32));
    down = register_module("down", torch::nn::Linear(32, 4));
  }
  c10::IValue forward(c10::IValue in) {
    const auto& e = in.toTupleRef().elements();
    return c10::ivalue::Tuple::create({down(torch::tanh(up(e[0].toTensor()))), e[1]});
  }
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    const auto& e = input.toTupleRef().elements();
    std::vector<c10::IValue> chunks;
    int64_t first = 0;
    for (int64_t n : rows) {
      chunks.emplace_back(c10::ivalue::Tuple::create(
          {e[0].toTensor().narrow(0, first, n), e[1].toTensor().narrow(0, first, n)}));
      first += n;
    }
    return chunks;
  }
};
TORCH_MODULE(RowPair);

// The squared error of scaled h against the target, summed and divided by
// a fixed count: a 0-dim loss that adds up over rows.
struct RowLossImpl : torch::nn::Cloneable<RowLossImpl>, SplitsInputRows {
  at::Tensor scale;
  RowLossImpl() { reset(); }
  void reset() override { scale = register_parameter("scale", torch::ones({4})); }
  at::Tensor forward(c10::IValue in) {
    const auto& e = in.toTupleRef().elements();
    return (e[0].toTensor() * scale - e[1].toTensor()).pow(2).sum() / (kRows * 4.0);
  }
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    return RowPair()->split_input_rows(input, rows);
  }
};
TORCH_MODULE(RowLoss);

torch::nn::Sequential loss_model() {
  torch::manual_seed(5);
  torch::nn::Sequential m;
  for (int l = 0; l < kLayers; ++l) m->push_back(RowPair());
  m->push_back(RowLoss());
  return m;
}

struct Case {
  const char* name;
  LossFn loss_fn;  // of the model's 0-dim output
  bool chunks;     // whether the tail may run in chunks of rows
};

class CallersLossChunksTest : public ::testing::TestWithParam<Case> {};

TEST_P(CallersLossChunksTest, ResultsArePlainLibTorchsOnWholeMicrobatches) {
  const auto& c = GetParam();
  const auto x = at::randn({kRows, 4}, at::detail::createCPUGenerator(1));
  const auto y = at::randn({kRows, 4}, at::detail::createCPUGenerator(2));
  const c10::IValue input = c10::ivalue::Tuple::create({x, y});
  std::atomic<int> reported{0};
  const LossFn counted = [&](const c10::IValue& out, const c10::IValue& label) {
    if (loss_value_is_reported()) ++reported;
    return c.loss_fn(out, label);
  };
  std::vector<int64_t> chunked;
  for (const int kib : {384, 448, 512}) {
    SCOPED_TRACE(std::to_string(kib) + " KiB");
    auto model = loss_model(), oracle = loss_model();
    RoundPipe pipe(model,
                   RoundPipeOptions().set_devices("sim:1,mem=" + std::to_string(kib) + "KiB"));
    const auto config = RunConfig().set_num_microbatch(kMicrobatches);
    const auto xs = microbatches_of(x, kMicrobatches), ys = microbatches_of(y, kMicrobatches);
    for (int call = 0; call < 4; ++call) {
      reported = 0;
      const auto loss = pipe.forward_backward(input, c10::IValue(), counted, false, config).loss;
      pipe.synchronize();
      EXPECT_EQ(reported.load(), kMicrobatches) << "the loss function's reported values";
      at::Tensor expected = at::zeros({});
      for (int m = 0; m < kMicrobatches; ++m) {
        const auto out =
            oracle->forward<at::Tensor>(c10::IValue(c10::ivalue::Tuple::create({xs[m], ys[m]})));
        expected = expected + c.loss_fn(out, c10::IValue());
      }
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
      expected.backward();
    }
    expect_same_state(model, oracle, /*grads=*/true);
    EXPECT_LE(pipe.devices().at(0)->memory_stats().peak_bytes, kib * 1024);
    EXPECT_EQ(pipe.pipeline_stats().calls_redone_for_the_loss_check, 0);
    chunked.push_back(pipe.pipeline_stats().tail_microbatches_in_row_chunks);
  }
  const bool any = std::any_of(chunked.begin(), chunked.end(), [](int64_t n) { return n > 0; });
  EXPECT_EQ(any, c.chunks) << ::testing::PrintToString(chunked);
}

INSTANTIATE_TEST_SUITE_P(
    CallersLoss, CallersLossChunksTest,
    ::testing::Values(
        Case{"linear", [](const c10::IValue& o, const c10::IValue&) { return o.toTensor() / 2; },
             true},
        Case{"square", [](const c10::IValue& o, const c10::IValue&) { return o.toTensor().pow(2); },
             false}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace roundpipe::testing

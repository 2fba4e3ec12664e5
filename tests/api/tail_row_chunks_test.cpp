// The fused tail in chunks of rows (Note [Tail row chunks]) against plain
// LibTorch: it replaces recompute where the loss adds up over rows, and an
// out-of-memory error in any chunk, the last microbatch's backward included,
// is recovered with the results of a call that never failed.
#include <ATen/CPUGeneratorImpl.h>

#include "api/oom_injection.h"
#include "api/oracle.h"

namespace roundpipe::testing {
namespace {

std::atomic<int> grad_forwards{0};

// WideProbe that splits its input by rows (Note [Tail row chunks]), and
// counts its recomputes and the rows it ran with grad.
std::atomic<int> recomputes{0};
struct RowSplitProbeImpl : torch::nn::Cloneable<RowSplitProbeImpl>, SplitsInputRows {
  torch::nn::Linear up{nullptr}, down{nullptr};
  RowSplitProbeImpl() { reset(); }
  void reset() override {
    up = register_module("up", torch::nn::Linear(4, 32));
    down = register_module("down", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (c10::GradMode::is_enabled()) ++(doing_recompute() ? recomputes : grad_forwards);
    // An out-of-memory error at the inject_at-th forward with grad (or
    // backward) since `probe_count` was reset.
    const auto when = inject_when.load();
    if (when == InjectWhen::kWithGrad && c10::GradMode::is_enabled() &&
        ++probe_count == inject_at && take_injected_oom())
      throw_injected_oom();
    auto y = down(torch::tanh(up(x)));
    if (when == InjectWhen::kBackward && y.requires_grad()) {
      y.register_hook([](const at::Tensor& g) {
        if (++probe_count == inject_at && take_injected_oom()) throw_injected_oom();
        return g;
      });
    }
    return y;
  }
  static inline std::atomic<int> probe_count{0};
  static inline int inject_at = 0;
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    return split_tensor_rows(input, rows);
  }
};
TORCH_MODULE(RowSplitProbe);

// What both TailRowChunks tests train: 8 RowSplitProbes on 1024 rows, in 2
// microbatches, with a loss that adds up over rows (a sum divided by a
// fixed count); and the plain LibTorch loss of the same call.
struct RowChunksCase {
  static constexpr int kLayers = 8, kMicrobatches = 2, kRows = 1024;
  const at::Tensor x = at::randn({kRows, 4}, at::detail::createCPUGenerator(1));
  const at::Tensor y = at::randn({kRows, 4}, at::detail::createCPUGenerator(2));
  const LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& label) {
    return (out.toTensor() - label.toTensor()).pow(2).sum() / (kRows * 4.0);
  };
  static torch::nn::Sequential model() {
    torch::manual_seed(4);
    torch::nn::Sequential m;
    for (int l = 0; l < kLayers; ++l) m->push_back(RowSplitProbe());
    return m;
  }
  at::Tensor plain_loss(torch::nn::Sequential& oracle) const {
    at::Tensor loss = at::zeros({});
    const auto xs = microbatches_of(x, kMicrobatches), ys = microbatches_of(y, kMicrobatches);
    for (int m = 0; m < kMicrobatches; ++m) loss = loss + loss_fn(oracle->forward(xs[m]), ys[m]);
    return loss;
  }
};

// Note [Tail row chunks]: where the loss adds up over rows and the layers
// split their rows, a budget that holds only some of the tail's layers'
// activations runs the tail in chunks of rows instead: no layer is
// recomputed, the results are plain LibTorch's, the device stays within
// its budget; without loss_sums_over_rows, or with ROUNDPIPE_TAIL_ROW_CHUNKS=0
// (the diagnostic switch), the same budget recomputes.
TEST(TailRowChunks, ChunksOfRowsReplaceRecomputeWhereTheLossAddsUp) {
  const RowChunksCase c;
  for (int variant = 0; variant < 3; ++variant) {
    const bool sums = variant != 1, switched_off = variant == 2;
    SCOPED_TRACE(switched_off ? "ROUNDPIPE_TAIL_ROW_CHUNKS=0"
                 : sums       ? "loss_sums_over_rows"
                              : "a loss of unknown form");
    if (switched_off) ::setenv("ROUNDPIPE_TAIL_ROW_CHUNKS", "0", 1);
    struct Unset {
      ~Unset() { ::unsetenv("ROUNDPIPE_TAIL_ROW_CHUNKS"); }
    } unset;
    auto model = RowChunksCase::model(), oracle = RowChunksCase::model();
    RoundPipe pipe(model, RoundPipeOptions().set_verbose(true).set_devices("sim:1,mem=448KiB"));
    const auto config =
        RunConfig().set_num_microbatch(RowChunksCase::kMicrobatches).set_loss_sums_over_rows(sums);
    int last_recomputes = 0;
    for (int call = 0; call < 4; ++call) {
      recomputes = 0;
      const auto loss = pipe.forward_backward(c.x, c.y, c.loss_fn, false, config).loss;
      pipe.synchronize();
      last_recomputes = recomputes.load();
      const auto expected = c.plain_loss(oracle);
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
      expected.backward();
    }
    expect_same_state(model, oracle, /*grads=*/true);
    EXPECT_LE(pipe.devices().at(0)->memory_stats().peak_bytes, 448 * 1024);
    const auto chunked = pipe.pipeline_stats().tail_microbatches_in_row_chunks;
    if (sums && !switched_off) {
      EXPECT_GT(chunked, 0) << "the tail never ran in chunks of rows";
      EXPECT_EQ(last_recomputes, 0) << "the last call still recomputed layers";
    } else {
      EXPECT_EQ(chunked, 0);
      EXPECT_GT(last_recomputes, 0) << "the budget is too large to show the difference";
    }
  }
}

// A RowSplitProbe that also keeps, for its backward, a table that is the
// same whatever its rows (as the CUDA fused loss keeps its weight's float32
// gradient), and says so (note_kept_bytes_independent_of_rows).
struct FixedTableProbeImpl : torch::nn::Cloneable<FixedTableProbeImpl>, SplitsInputRows {
  static constexpr int64_t kTableFloats = 48 * 1024;  // 192 KiB
  static inline std::atomic<bool> tells{true};
  torch::nn::Linear up{nullptr}, down{nullptr};
  FixedTableProbeImpl() { reset(); }
  void reset() override {
    up = register_module("up", torch::nn::Linear(4, 32));
    down = register_module("down", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto y = down(torch::tanh(up(x)));
    if (!c10::GradMode::is_enabled()) return y;
    // dot(table, table) keeps the table for its backward; it adds 0.
    const auto table = up->weight.sum().expand({kTableFloats}).contiguous();
    if (tells) note_kept_bytes_independent_of_rows(table.nbytes());
    return y + at::dot(table, table) * 0;
  }
  std::vector<c10::IValue> split_input_rows(const c10::IValue& input,
                                            const std::vector<int64_t>& rows) const override {
    return split_tensor_rows(input, rows);
  }
};
TORCH_MODULE(FixedTableProbe);

// Note [Tail grain]: what the tail's last layer keeps whatever its rows is
// counted whole in each chunk of rows, so the plan's predicted peak bounds
// what the device holds, and the results are plain LibTorch's. Counted by
// a chunk's share of the rows (the layer does not say), the prediction
// falls short of the peak.
TEST(TailRowChunks, WhatALayerKeepsWhateverItsRowsIsCountedWholeInEachChunk) {
  const RowChunksCase c;
  auto make = [] {
    torch::manual_seed(4);
    torch::nn::Sequential m;
    for (int l = 0; l + 1 < RowChunksCase::kLayers; ++l) m->push_back(RowSplitProbe());
    m->push_back(FixedTableProbe());
    return m;
  };
  for (bool tells : {true, false}) {
    SCOPED_TRACE(tells ? "the layer says" : "the layer does not say");
    FixedTableProbeImpl::tells = tells;
    auto model = make(), oracle = make();
    RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1,mem=1MiB"));
    const auto config =
        RunConfig().set_num_microbatch(RowChunksCase::kMicrobatches).set_loss_sums_over_rows(true);
    for (int call = 0; call < 4; ++call) {
      if (call == 2) pipe.devices().at(0)->reset_peak_memory();  // the plans measured
      const auto loss = pipe.forward_backward(c.x, c.y, c.loss_fn, false, config).loss;
      pipe.synchronize();
      const auto expected = c.plain_loss(oracle);
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
      expected.backward();
    }
    expect_same_state(model, oracle, /*grads=*/true);
    EXPECT_GT(pipe.pipeline_stats().tail_microbatches_in_row_chunks, 0);
    const auto plan = pipe.auto_plan(true, RowChunksCase::kMicrobatches, 0, std::nullopt,
                                     RowChunksCase::kRows / RowChunksCase::kMicrobatches);
    const int64_t predicted = plan.largest_peak_bytes();
    const int64_t peak = pipe.devices().at(0)->memory_stats().peak_bytes;
    if (tells) {
      EXPECT_EQ(pipe.pipeline_stats().out_of_memory_recoveries, 0);
      EXPECT_LE(peak, predicted) << plan.describe();
    } else {
      // (Two or more chunks: a quarter of the table or more is missed, kTableFloats bytes.)
      EXPECT_GT(peak, predicted + FixedTableProbeImpl::kTableFloats) << plan.describe();
    }
  }
  FixedTableProbeImpl::tells = true;
}

// An out-of-memory error in a later chunk of rows is recovered, and the
// results are still plain LibTorch's: in its forward the chunk is retried
// alone; in its backward, after earlier chunks left gradients, the call is
// redone (Note [Out-of-memory retry of a microbatch]).
TEST(TailRowChunks, RunningOutOfMemoryInAChunkIsRetried) {
  const RowChunksCase c;
  for (auto when : {InjectWhen::kWithGrad, InjectWhen::kBackward}) {
    SCOPED_TRACE(when == InjectWhen::kWithGrad ? "forward" : "backward");
    auto model = RowChunksCase::model(), oracle = RowChunksCase::model();
    RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1,mem=448KiB"));
    const auto config =
        RunConfig().set_num_microbatch(RowChunksCase::kMicrobatches).set_loss_sums_over_rows(true);
    for (int call = 0; call < 3; ++call) {
      const bool inject = call == 2;  // once the tail runs in chunks
      if (inject) {
        ASSERT_GT(pipe.pipeline_stats().tail_microbatches_in_row_chunks, 0);
        inject_when = when;
        RowSplitProbeImpl::probe_count = 0;
        RowSplitProbeImpl::inject_at = 2 * RowChunksCase::kLayers + 3;  // the third chunk's
        injected_ooms = 1;
      }
      const auto loss = pipe.forward_backward(c.x, c.y, c.loss_fn, false, config).loss;
      pipe.synchronize();
      if (inject) EXPECT_EQ(injected_ooms.load(), 0) << "the injected error was not raised";
      injected_ooms = 0;
      inject_when = InjectWhen::kForward;
      const auto expected = c.plain_loss(oracle);
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
      expected.backward();
    }
    expect_same_state(model, oracle, /*grads=*/true);
    EXPECT_EQ(pipe.pipeline_stats().out_of_memory_recoveries, 1);
  }
}

// Each tail job hands its last microbatch's loss over only once that
// microbatch's backward is done (StageBinding::hold_results): an
// out-of-memory error there, after the earlier microbatches left their
// gradients, redoes the call before forward_backward returns. It never
// reaches the caller, and the results are plain LibTorch's; in chunks of
// rows, and in whole microbatches that recompute some of the tail's layers.
TEST(TailRowChunks, RunningOutOfMemoryInTheLastBackwardRedoesTheCallBeforeItReturns) {
  const RowChunksCase c;
  const auto last_row = c.y[RowChunksCase::kRows - 1];
  for (bool sums : {true, false}) {
    SCOPED_TRACE(sums ? "chunks of rows" : "whole microbatches");
    std::atomic<bool> inject{false};
    std::atomic<int> injected{0};
    // The loss of the rows that end the batch (the last microbatch's, its
    // last chunk's) raises the error at the first step of its backward.
    const LossFn loss_fn = [&](const c10::IValue& out, const c10::IValue& label) {
      auto loss = c.loss_fn(out, label);
      const auto& rows = label.toTensor();
      if (inject && loss.requires_grad() && at::equal(rows[rows.size(0) - 1], last_row)) {
        loss.register_hook([&](const at::Tensor& g) {
          if (inject.exchange(false)) {
            ++injected;
            throw_injected_oom();
          }
          return g;
        });
      }
      return loss;
    };
    auto model = RowChunksCase::model(), oracle = RowChunksCase::model();
    RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:1,mem=448KiB"));
    const auto config =
        RunConfig().set_num_microbatch(RowChunksCase::kMicrobatches).set_loss_sums_over_rows(sums);
    for (int call = 0; call < 3; ++call) {
      inject = call == 2;  // once the plan keeps activations (measured)
      at::Tensor loss;
      ASSERT_NO_THROW({
        loss = pipe.forward_backward(c.x, c.y, loss_fn, false, config).loss;
        pipe.synchronize();
      });
      const auto expected = c.plain_loss(oracle);
      EXPECT_TENSOR_NEAR(loss, expected, kTol, "loss of call " << call);
      expected.backward();
    }
    EXPECT_EQ(injected.load(), 1) << "the injected error was not raised";
    EXPECT_EQ(pipe.pipeline_stats().out_of_memory_recoveries, 1);
    EXPECT_EQ(pipe.pipeline_stats().tail_microbatches_in_row_chunks > 0, sums);
    expect_same_state(model, oracle, /*grads=*/true);
  }
}

}  // namespace
}  // namespace roundpipe::testing

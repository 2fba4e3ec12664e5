// The memory- and transfer-aware automatic plan: fits a device-memory limit,
// names the smallest feasible limit when none fits, keeps uploads hidden
// behind compute, and a RoundPipe on a small simulated device trains with
// the plan it picks (against plain LibTorch).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "roundpipe/planner.h"
#include "roundpipe/roundpipe.h"
#include "test_util.h"

namespace roundpipe {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::vector<LayerCost> equal_layers(int n, int64_t bytes, int64_t activation = 0) {
  auto costs = costs_from_bytes(std::vector<int64_t>(n, bytes), std::vector<int64_t>(n, bytes));
  for (auto& c : costs) c.activation_bytes = activation;
  return costs;
}

// One device, the fused tail in layer grain growing its layers with grad,
// at least two stages, a 300 MiB limit: the row-chunk tests' request.
PlanRequest growing_tail_request() {
  PlanRequest request;
  request.num_devices = 1;
  request.fused = true;
  request.layer_grain = true;
  request.grow_tail_with_grad = true;
  request.min_stages = 2;
  request.memory_limit_bytes = 300 * kMiB;
  return request;
}

// `plan` as the plan in use, priced (its tail grown) by plan_stages: kept
// within any margin where it fits the limit, else the planner's own.
PlanEstimate priced_in_use(const std::vector<LayerCost>& layers, PlanRequest request,
                           const ExecutePlan& plan) {
  request.incumbent = &plan;
  request.keep_within = 1e9;
  return plan_stages(layers, request);
}

// A stage's peak: while it runs (parameters, gradients, activations), the
// next stage's parameters arrive (as many bytes as its own, the planner
// assumes).
int64_t peak_of(const StageEstimate& s) {
  return s.memory_bytes + s.param_bytes;
}

TEST(Planner, EveryStageFitsTheLimitWithTheNextStagesParameters) {
  const auto layers = equal_layers(12, 100 * kMiB, 20 * kMiB);
  size_t previous_stages = 0;
  for (int64_t limit_mib : {8000, 2000, 1000, 500}) {
    PlanRequest request;
    request.num_devices = 2;
    request.fused = true;
    request.memory_limit_bytes = limit_mib * kMiB;
    const auto estimate = plan_stages(layers, request);
    estimate.plan.validate(12, true);
    for (const auto& s : estimate.stages) {
      EXPECT_LE(peak_of(s), request.memory_limit_bytes)
          << limit_mib << " MiB: " << estimate.describe();
      EXPECT_LE(s.peak_bytes, request.memory_limit_bytes) << estimate.describe();
    }
    // A tighter limit never allows fewer stages.
    EXPECT_GE(estimate.stages.size(), previous_stages) << estimate.describe();
    previous_stages = estimate.stages.size();
  }
  // At 500 MiB a backward stage holds at most one layer: two need
  // 2 x (100 + 100 + 20) + 2 x 100 = 640 MiB.
  PlanRequest tight;
  tight.num_devices = 2;
  tight.memory_limit_bytes = 500 * kMiB;
  for (const auto& s : plan_stages(layers, tight).stages) {
    if (s.backward) EXPECT_EQ(s.range.size(), 1);
  }
}

// A layer's working memory (temporaries, logit chunks) is held by one layer
// at a time: a stage adds its largest once, in stage and in layer grain.
TEST(Planner, AStageAddsTheLargestWorkingMemoryOfItsLayersOnce) {
  auto layers = equal_layers(4, 100 * kMiB, 20 * kMiB);
  layers[1].working_bytes = 30 * kMiB;
  layers[2].working_bytes = 50 * kMiB;
  for (bool layer_grain : {false, true}) {
    PlanRequest request;
    request.num_devices = 1;
    request.fused = true;
    request.layer_grain = layer_grain;
    request.min_stages = 2;
    const auto estimate = plan_stages(layers, request);
    for (const auto& s : estimate.stages) {
      int64_t params = 0, acts = 0, max_act = 0, working = 0;
      for (int l = s.range.begin; l < s.range.end; ++l) {
        params += layers[l].param_bytes;
        acts += layers[l].activation_bytes;
        max_act = std::max(max_act, layers[l].activation_bytes);
        working = std::max(working, layers[l].working_bytes);
      }
      const int64_t expected = s.backward ? 2 * params + (layer_grain ? max_act : acts) + working
                                          : params + max_act + working;
      EXPECT_EQ(s.memory_bytes, expected) << estimate.describe();
    }
  }
}

// Note [Tail grain]: in layer grain the fused tail runs as many of its last
// layers with grad as the limit holds, and its estimate says so.
TEST(Planner, TheTailRunsAsManyLastLayersWithGradAsTheLimitHolds) {
  const auto layers = equal_layers(8, 10 * kMiB, 40 * kMiB);
  PlanRequest request;
  request.num_devices = 1;
  request.fused = true;
  request.layer_grain = true;
  request.min_stages = 2;
  request.memory_limit_bytes = 1000 * kMiB;
  const auto plain = plan_stages(layers, request);
  const auto& plain_tail = plain.stages.at(plain.plan.forward.size());
  EXPECT_EQ(plain_tail.layers_with_grad, 0) << "not asked for";
  request.grow_tail_with_grad = true;
  // (A long tail, held as the plan in use: the planner's own would be short
  // enough to keep every layer.)
  const ExecutePlan long_tail({{0, 2}}, {{2, 8}, {0, 2}});
  for (int64_t limit_mib : {1000, 400, 250}) {
    request.memory_limit_bytes = limit_mib * kMiB;
    const auto e = priced_in_use(layers, request, long_tail);
    ASSERT_EQ(e.plan.to_string(), long_tail.to_string()) << e.describe();
    const auto& tail = e.stages.at(e.plan.forward.size());
    const int n = tail.range.size();
    // The tail holds parameters and gradients (20 MiB a layer) and the next
    // stage's parameters, plus 40 MiB of activations per layer with grad.
    int64_t next_params = 0;
    for (const auto& s : e.stages) {
      if (&s != &tail && e.stages.size() > 1) next_params = std::max(next_params, s.param_bytes);
    }
    const int64_t fixed = tail.peak_bytes - 40 * kMiB * tail.layers_with_grad;
    ASSERT_GE(tail.layers_with_grad, 1) << e.describe();
    ASSERT_LE(tail.layers_with_grad, n) << e.describe();
    EXPECT_LE(tail.peak_bytes, request.memory_limit_bytes) << e.describe();
    if (tail.layers_with_grad < n) {
      EXPECT_GT(fixed + 40 * kMiB * (tail.layers_with_grad + 1), request.memory_limit_bytes)
          << "one more layer would have fit: " << e.describe();
    }
    if (limit_mib == 1000) EXPECT_EQ(tail.layers_with_grad, n) << e.describe();
    if (limit_mib == 250) EXPECT_LT(tail.layers_with_grad, n) << e.describe();
  }
}

// Note [Tail row chunks]: where one chunk of a microbatch's rows does not
// keep every tail layer's activations, the tail runs in the fewest chunks
// of rows that do (and its predicted time drops by the forwards it no
// longer recomputes); not where the tail begins before the layers that
// split their rows.
TEST(Planner, TheTailRunsInTheFewestRowChunksThatKeepEveryLayer) {
  const auto layers = equal_layers(8, 10 * kMiB, 40 * kMiB);
  auto request = growing_tail_request();
  // (A long tail, held as the plan in use: the planner's own would be short
  // enough to keep every layer in one chunk.)
  const ExecutePlan long_tail({{0, 2}}, {{2, 8}, {0, 2}});
  const auto whole = priced_in_use(layers, request, long_tail);
  ASSERT_EQ(whole.plan.to_string(), long_tail.to_string()) << whole.describe();
  const auto& whole_tail = whole.stages.at(whole.plan.forward.size());
  ASSERT_LT(whole_tail.layers_with_grad, whole_tail.range.size()) << whole.describe();
  EXPECT_EQ(whole_tail.row_chunks, 1);
  request.tail_rows = 8;
  request.first_row_split_layer = 0;
  const auto chunked = priced_in_use(layers, request, long_tail);
  const auto& tail = chunked.stages.at(chunked.plan.forward.size());
  const int n = tail.range.size();
  EXPECT_EQ(tail.layers_with_grad, n) << chunked.describe();
  ASSERT_GT(tail.row_chunks, 1) << chunked.describe();
  EXPECT_LE(tail.peak_bytes, request.memory_limit_bytes) << chunked.describe();
  EXPECT_LT(chunked.iteration, whole.iteration) << "the recomputed forwards are priced";
  // The tail holds its parameters and gradients (no second copy: their
  // backward adds in place), the next stage's parameters (forward [0, 2):
  // 20 MiB), and every layer's activations of one chunk (of ceil(8 /
  // chunks) rows).
  const auto acts = [&](int chunks) { return 40 * kMiB * n * ((8 + chunks - 1) / chunks) / 8; };
  const int64_t fixed = tail.peak_bytes - acts(tail.row_chunks);
  EXPECT_EQ(fixed, 10 * kMiB * (2 * n + 2)) << chunked.describe();
  EXPECT_GT(fixed + acts(tail.row_chunks - 1), request.memory_limit_bytes)
      << "fewer chunks would have kept every layer: " << chunked.describe();
  request.first_row_split_layer = tail.range.begin + 1;
  const auto unsplit = priced_in_use(layers, request, long_tail);
  EXPECT_EQ(unsplit.stages.at(unsplit.plan.forward.size()).row_chunks, 1) << unsplit.describe();
}

// Note [Tail grain]: what a layer keeps whatever its rows (the CUDA fused
// loss's float32 weight gradient) is counted whole in each chunk of rows,
// not by the chunk's share, and so are the input gradients of a
// microbatch's chunks before the last, kept until it is done: the tail
// takes more chunks to keep every layer, and its predicted peak holds it all.
TEST(Planner, WhatALayerKeepsWhateverItsRowsIsCountedWholeInEachChunk) {
  auto layers = equal_layers(8, 10 * kMiB, 40 * kMiB);
  const int64_t whole = 60 * kMiB;  // the last layer's, beside its 40 MiB by rows
  layers.back().activation_bytes += whole;
  layers.back().activation_bytes_independent_of_rows = whole;
  const int64_t input = 16 * kMiB;  // the tail's input: layer 1's output
  layers[1].output_bytes = input;
  auto request = growing_tail_request();
  request.tail_rows = 8;
  request.first_row_split_layer = 0;
  const ExecutePlan long_tail({{0, 2}}, {{2, 8}, {0, 2}});
  const auto chunked = priced_in_use(layers, request, long_tail);
  ASSERT_EQ(chunked.plan.to_string(), long_tail.to_string()) << chunked.describe();
  const auto& tail = chunked.stages.at(chunked.plan.forward.size());
  const int n = tail.range.size();
  EXPECT_EQ(tail.layers_with_grad, n) << chunked.describe();
  ASSERT_GT(tail.row_chunks, 1) << chunked.describe();
  EXPECT_LE(tail.peak_bytes, request.memory_limit_bytes) << chunked.describe();
  // Parameters, gradients, the next stage's parameters; one chunk's share
  // of every layer's activations by rows; the last layer's whole; and the
  // earlier chunks' input gradients (all rows but the last chunk's).
  const auto acts = [&](int chunks) { return 40 * kMiB * n * ((8 + chunks - 1) / chunks) / 8; };
  const auto earlier = [&](int chunks) {
    return chunks > 1 ? input - input * (8 / chunks) / 8 : 0;
  };
  const int64_t held = 10 * kMiB * (2 * n + 2);
  EXPECT_EQ(tail.peak_bytes, held + acts(tail.row_chunks) + whole + earlier(tail.row_chunks))
      << chunked.describe();
  const int fewer = tail.row_chunks - 1;
  EXPECT_GT(held + acts(fewer) + whole + earlier(fewer), request.memory_limit_bytes)
      << "fewer chunks would have kept every layer: " << chunked.describe();
}

// Note [Tail row chunks]: microbatches of unequal rows (10 rows in 4: 3, 3,
// 2, 2) run in as many chunks as the smallest has rows, and each chunk of
// the largest keeps the largest share of a layer's activations, which are
// the largest microbatch's: in 2 chunks, 2 of its 3 rows, not half. Counted
// by the smallest's share, the tail would keep every layer and its peak
// would pass the limit.
TEST(Planner, ChunksOfTheLargestMicrobatchAreCountedByItsRows) {
  const auto layers = equal_layers(8, 10 * kMiB, 45 * kMiB);
  auto request = growing_tail_request();
  request.first_row_split_layer = 0;
  request.tail_rows = 2;
  const ExecutePlan long_tail({{0, 2}}, {{2, 8}, {0, 2}});
  const int n = 6;                               // the tail's layers
  const int64_t held = 10 * kMiB * (2 * n + 2);  // parameters, gradients, the next stage's
  // Equal microbatches of 2 rows: 2 chunks of 1 row keep every layer.
  const auto even = priced_in_use(layers, request, long_tail);
  const auto& even_tail = even.stages.at(even.plan.forward.size());
  ASSERT_EQ(even_tail.row_chunks, 2) << even.describe();
  EXPECT_EQ(even_tail.layers_with_grad, n) << even.describe();
  EXPECT_EQ(even_tail.peak_bytes, held + n * 45 * kMiB / 2) << even.describe();
  // The largest has 3: a chunk keeps 2/3 of each layer's 45 MiB, 30 MiB,
  // and the limit holds only some layers so.
  request.tail_rows_largest = 3;
  const auto uneven = priced_in_use(layers, request, long_tail);
  const auto& tail = uneven.stages.at(uneven.plan.forward.size());
  ASSERT_EQ(uneven.plan.to_string(), long_tail.to_string()) << uneven.describe();
  EXPECT_EQ(tail.row_chunks, 2) << "no more chunks than the smallest microbatch has rows";
  const int k = tail.layers_with_grad;
  EXPECT_LT(k, n) << uneven.describe();
  EXPECT_EQ(tail.peak_bytes, held + k * 30 * kMiB) << uneven.describe();
  EXPECT_LE(tail.peak_bytes, request.memory_limit_bytes) << uneven.describe();
  EXPECT_GT(held + (k + 1) * 30 * kMiB, request.memory_limit_bytes) << uneven.describe();
}

// Note [Tail grain]: every candidate is priced with the forwards its tail
// recomputes, not only the plan chosen. Priced as if the tail kept every
// layer, a long tail that keeps few looked a forward per layer cheaper than
// the stages it replaces, and won. The oracle: every split of the model
// into a forward stage, a tail and a backward stage, each priced alone (as
// the plan in use, within any margin).
TEST(Planner, EveryCandidateIsPricedWithTheForwardsItsTailRecomputes) {
  const int L = 12;
  const auto layers = equal_layers(L, 10 * kMiB, 40 * kMiB);
  PlanRequest request;
  request.num_devices = 1;
  request.num_microbatches = 4;
  request.fused = true;
  request.layer_grain = true;
  request.grow_tail_with_grad = true;
  request.memory_limit_bytes = 400 * kMiB;
  const auto chosen = plan_stages(layers, request);
  const auto& tail = chosen.stages.at(chosen.plan.forward.size());
  // A layer the tail cannot keep costs what it costs in a backward stage (a
  // forward, a recompute, a backward): at most one such layer, a tie.
  EXPECT_GE(tail.layers_with_grad, tail.range.size() - 1)
      << "a tail that recomputes is no faster than a shorter one: " << chosen.describe();
  int splits_priced = 0;
  double longest_tail_time = 0;
  for (int begin = 0; begin < L; ++begin) {
    const auto split = begin == 0 ? ExecutePlan({}, {{0, L}})
                                  : ExecutePlan({{0, begin}}, {{begin, L}, {0, begin}});
    const auto priced = priced_in_use(layers, request, split);
    if (priced.plan.backward.front().begin != begin) continue;  // does not fit
    ++splits_priced;
    if (longest_tail_time == 0) longest_tail_time = priced.iteration;
    EXPECT_LE(chosen.iteration, priced.iteration * (1 + 1e-9))
        << "tail from layer " << begin << ":\n"
        << priced.describe() << "\nchosen:\n"
        << chosen.describe();
  }
  EXPECT_GE(splits_priced, 3);
  EXPECT_LT(chosen.iteration, longest_tail_time) << chosen.describe();
}

// peak_bytes (what the limit is checked against) adds the parameters of the
// stage that arrives on the same device while a stage runs: with 2 devices,
// the one two later in the cyclic order forward..., backward...
TEST(Planner, StagePeakAddsTheParametersArrivingNextOnItsDevice) {
  const auto layers = equal_layers(4, 100 * kMiB, 20 * kMiB);
  PlanRequest request;
  request.num_devices = 2;
  request.fused = true;
  ExecutePlan plan;
  plan.forward = {{0, 1}};
  plan.backward = {{2, 4}, {1, 2}};
  const auto e = estimate_plan(layers, plan, request);
  ASSERT_EQ(e.stages.size(), 3u);
  // forward [0, 1) -> backward [1, 2) (1 layer); backward [2, 4) -> forward
  // [0, 1) (1 layer, next call); backward [1, 2) -> backward [2, 4) (2 layers).
  EXPECT_EQ(e.stages[0].peak_bytes - e.stages[0].memory_bytes, 100 * kMiB) << e.describe();
  EXPECT_EQ(e.stages[1].peak_bytes - e.stages[1].memory_bytes, 100 * kMiB) << e.describe();
  EXPECT_EQ(e.stages[2].peak_bytes - e.stages[2].memory_bytes, 200 * kMiB) << e.describe();
  EXPECT_NE(e.describe().find("with the next stage's parameters"), std::string::npos);
  // A replicated tail: the next call's copy of the same stage.
  ExecutePlan tail;
  tail.backward = {{0, 4}};
  tail.tail_replicas = 2;
  const auto t = estimate_plan(layers, tail, request);
  EXPECT_EQ(t.stages[0].peak_bytes - t.stages[0].memory_bytes, 400 * kMiB) << t.describe();
}

TEST(Planner, ImpossibleLimitNamesTheSmallestFeasibleOne) {
  auto layers = equal_layers(6, 100 * kMiB, 10 * kMiB);
  // As a backward stage, 610 MiB, and 300 MiB of parameters arriving after it.
  layers[3].param_bytes = layers[3].grad_bytes = 300 * kMiB;
  PlanRequest request;
  request.memory_limit_bytes = 600 * kMiB;  // layer 3 alone needs 610
  try {
    plan_stages(layers, request);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("layer 3 alone needs"), std::string::npos) << message;
    // One layer per stage: 610 + 300 MiB = 0.888672 GiB
    EXPECT_NE(message.find("smallest feasible limit is at most 0.888672 GiB"), std::string::npos)
        << message;
  }
  request.memory_limit_bytes = 910 * kMiB;  // enough
  EXPECT_NO_THROW(plan_stages(layers, request));
  // With the real neighbours (100 MiB of parameters after layer 3), less is.
  request.memory_limit_bytes = 720 * kMiB;
  EXPECT_NO_THROW(plan_stages(layers, request));
}

TEST(Planner, KeepsAHeavyUploadBehindCompute) {
  // Layer 0 has many parameters and little compute (an embedding); the rest
  // compute a lot. With a slow link, a stage of layer 0 alone would wait for
  // its upload; the planner groups it with compute.
  std::vector<LayerCost> layers(8);
  for (int l = 0; l < 8; ++l) layers[l] = {10, 10, 20, 100 * kMiB, 100 * kMiB, 0};
  layers[0] = {0.1, 0.1, 0.2, 1000 * kMiB, 1000 * kMiB, 0};
  PlanRequest request;
  request.num_devices = 2;
  request.num_microbatches = 3;
  const auto free_upload = plan_stages(layers, request);
  request.upload_bytes_per_second = 100.0 * kMiB;  // layer 0 uploads in 10, computes in 0.1
  const auto slow_upload = plan_stages(layers, request);
  // The plan chosen for a free link, costed with the slow one, is no better.
  EXPECT_LE(slow_upload.iteration, estimate_plan(layers, free_upload.plan, request).iteration);
  for (const auto& s : slow_upload.stages) {
    if (!s.backward && s.range.begin == 0) {
      EXPECT_GT(s.range.size(), 1) << slow_upload.describe();
    }
  }
  EXPECT_FALSE(slow_upload.describe().empty());
}

TEST(Planner, DefaultPlanRespectsASmallSimulatedDevice) {
  // 6 layers of 64x64 floats (16 KiB + bias) on a device with little memory:
  // the RoundPipe's automatic plan must keep each stage's peak under the
  // limit, and training must still match plain LibTorch.
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < 6; ++l) model->push_back(torch::nn::Linear(64, 64));
  auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  const int64_t layer_bytes = (64 * 64 + 64) * 4;
  // A stage: params + grads of one layer and the next one's params, within
  // half the limit until the activations are measured.
  const double limit_gib = 7.0 * layer_bytes / (1 << 30);
  RoundPipe pipe(model,
                 RoundPipeOptions().set_devices("sim:2").set_model_memory_limit_gib(limit_gib));
  const auto estimate = pipe.auto_plan(/*fused=*/true, 3);
  for (const auto& s : estimate.stages) {
    EXPECT_LE(peak_of(s), static_cast<int64_t>(limit_gib * (1 << 30))) << estimate.describe();
  }
  EXPECT_EQ(pipe.default_plan(true).to_string(), estimate.plan.to_string());

  auto x = torch::randn({6, 64}), y = torch::randn({6, 64});
  auto loss =
      pipe.forward_backward(x, y, testing::mse_loss, false, RunConfig().set_num_microbatch(3)).loss;
  pipe.synchronize();
  torch::nn::Sequential plain(reference);
  auto expected = testing::plain_microbatch_loss(plain, x, y, 3, c10::kCPU);
  expected.backward();
  EXPECT_TENSOR_NEAR(loss, expected.detach(), 1e-5, "loss");
  auto ours = model->parameters(), theirs = plain->parameters();
  for (size_t i = 0; i < ours.size(); ++i)
    EXPECT_TENSOR_NEAR(ours[i].grad(), theirs[i].grad(), 1e-5, "grad");

  // A limit below one layer's needs fails the call with the smallest feasible limit.
  RoundPipe tiny(plain,
                 RoundPipeOptions().set_devices("sim:1").set_model_memory_limit_gib(limit_gib / 4));
  try {
    tiny.forward_backward(x, y, testing::mse_loss);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("smallest feasible limit"),
              std::string::npos);
  }
}

// Layer grain holds one layer's activations at a time in a backward stage,
// stage grain all of them: under the same limit, stage grain needs more
// (smaller) stages.
TEST(Planner, LayerGrainHoldsOneLayersActivations) {
  const auto layers = equal_layers(8, 10 * kMiB, 200 * kMiB);
  PlanRequest request;
  request.fused = true;
  request.memory_limit_bytes = 1000 * kMiB;
  const auto stage = plan_stages(layers, request);
  request.layer_grain = true;
  const auto layer = plan_stages(layers, request);
  for (const auto* e : {&stage, &layer}) {
    for (const auto& s : e->stages) EXPECT_LE(peak_of(s), request.memory_limit_bytes);
  }
  // Stage grain: 4 layers at most (4 x 220 + 40 = 920 MiB fits, 5 do not).
  for (const auto& s : stage.stages) {
    if (s.backward) EXPECT_LE(s.range.size(), 4) << stage.describe();
  }
  EXPECT_GT(stage.stages.size(), layer.stages.size()) << stage.describe() << "\n"
                                                      << layer.describe();
  // Layer grain: the whole model in one stage fits (8 x 20 + 200 + 80 MiB).
  EXPECT_EQ(layer.plan.backward.size(), 1u) << layer.describe();
}

// Note [Thin checkpoints]: layer-from-stage grain holds what layer grain
// holds on the device, and a backward stage's time adds the forward of its
// layers but the last (the rerun that finds their inputs); the fused tail's
// is with_tail_grown's, as in layer grain.
TEST(Planner, LayerFromStageAddsTheRerunOfABackwardStagesLayersButTheLast) {
  auto layers = equal_layers(8, 10 * kMiB, 200 * kMiB);
  for (size_t l = 0; l < layers.size(); ++l) layers[l].forward = 1.0 + l;
  PlanRequest request;
  request.fused = true;
  request.layer_grain = true;
  const auto plan = ExecutePlan({{0, 4}}, {{4, 8}, {0, 4}});
  const auto layer = estimate_plan(layers, plan, request);
  request.rerun_from_stage_input = true;
  const auto thin = estimate_plan(layers, plan, request);
  ASSERT_EQ(thin.stages.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(thin.stages[i].peak_bytes, layer.stages[i].peak_bytes) << i;
    // Forward stage and tail unchanged; the backward stage [0, 4) reruns
    // layers 0, 1 and 2 (forward 1 + 2 + 3).
    EXPECT_DOUBLE_EQ(thin.stages[i].compute, layer.stages[i].compute + (i == 2 ? 6.0 : 0.0)) << i;
  }
  EXPECT_GT(thin.iteration, layer.iteration);
}

// Layer-from-stage grain saves host memory only with few backward stages:
// asked for (no host limit), the plan keeps the fewest checkpoints; under a
// host limit, the fastest plan within it.
TEST(Planner, LayerFromStageKeepsTheFewestCheckpointsOrTheFastestWithinTheHostLimit) {
  std::vector<LayerCost> layers(8);
  for (size_t l = 0; l < layers.size(); ++l) {
    layers[l] = {1.0, 1.0, 2.0, 50 * kMiB, 0, 100 * kMiB, 0, kMiB};
    if (l % 3 == 0) layers[l].backward = 6.0;  // uneven: balance wants many stages
  }
  PlanRequest request;
  request.fused = true;
  request.layer_grain = true;
  request.num_microbatches = 2;
  request.memory_limit_bytes = 500 * kMiB;  // four layers a stage at most
  const auto layer = plan_stages(layers, request);
  request.rerun_from_stage_input = true;
  const auto fewest = plan_stages(layers, request);
  EXPECT_LT(fewest.checkpoint_bytes, layer.checkpoint_bytes) << fewest.describe();
  // Two backward stages of four: the tail, and [0, 4), whose input is the
  // caller's.
  EXPECT_EQ(fewest.checkpoint_bytes, 0) << fewest.describe();
  request.host_checkpoint_limit_bytes = int64_t{1} << 40;
  const auto fastest = plan_stages(layers, request);
  EXPECT_LE(fastest.iteration, fewest.iteration);
  ASSERT_GT(fastest.checkpoint_bytes, 0) << fastest.describe();
  request.host_checkpoint_limit_bytes = fastest.checkpoint_bytes - kMiB;
  const auto within = plan_stages(layers, request);
  EXPECT_LE(within.checkpoint_bytes, request.host_checkpoint_limit_bytes) << within.describe();
  for (const auto* e : {&layer, &fewest, &fastest, &within}) {
    for (const auto& s : e->stages) EXPECT_LE(s.peak_bytes, request.memory_limit_bytes);
  }
}

// Note [Thin checkpoints]: once activations are measured, a backward
// stage's rerun keeps the inputs of its layers but the last on the device
// (a microbatch's; the outputs before them stand for them), and its memory
// counts them: longer stages hold more there, so under a device limit the
// fewest checkpoints come with shorter stages. The fused tail keeps its
// recompute's inputs on the host, and its memory does not change.
TEST(Planner, LayerFromStageCountsTheRerunsInputsOnTheDevice) {
  std::vector<LayerCost> layers(8);
  for (auto& l : layers) l = {1.0, 1.0, 2.0, 50 * kMiB, 0, 100 * kMiB, 0, 40 * kMiB};
  PlanRequest request;
  request.fused = true;
  request.layer_grain = true;
  request.rerun_from_stage_input = true;
  request.num_microbatches = 2;
  const auto plan = ExecutePlan({{0, 4}}, {{4, 8}, {0, 4}});
  const auto on_host = estimate_plan(layers, plan, request);
  request.rerun_inputs_on_device = true;
  const auto on_device = estimate_plan(layers, plan, request);
  EXPECT_TRUE(on_device.rerun_inputs_on_device);
  ASSERT_EQ(on_device.stages.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    // [0, 4) keeps the inputs of layers 0, 1 and 2: three 40 MiB outputs.
    EXPECT_EQ(on_device.stages[i].memory_bytes,
              on_host.stages[i].memory_bytes + (i == 2 ? 3 * 40 * kMiB : 0))
        << i << "\n"
        << on_device.describe();
  }
  EXPECT_EQ(on_device.checkpoint_bytes, on_host.checkpoint_bytes);

  // Under 500 MiB a backward stage of four (200 MiB of parameters, 100 of
  // activations, 120 of inputs and the next stage's 200) does not fit, one
  // of three does (480); the tail of four does (500).
  request.memory_limit_bytes = 500 * kMiB;
  const auto fewest = plan_stages(layers, request);
  for (const auto& s : fewest.stages) EXPECT_LE(s.peak_bytes, request.memory_limit_bytes);
  const auto& tail = fewest.plan.backward.front();
  EXPECT_EQ(tail.end - tail.begin, 4) << fewest.describe();
  EXPECT_GT(fewest.plan.backward.size(), 2u) << fewest.describe();
  request.rerun_inputs_on_device = false;
  EXPECT_LT(plan_stages(layers, request).checkpoint_bytes, fewest.checkpoint_bytes);
}

// A first call's plan in layer-from-stage grain, on byte costs (the 32B
// shape's: 64 decoder layers of 0.242 GiB between an embedding and a head of
// 1.449) under a 20.25 GiB limit with three quarters held back: output
// bytes are not measured yet, so every plan's checkpoints weigh 0 bytes,
// and the plan took the fastest, one layer a backward stage (no rerun),
// every layer's input a checkpoint (41 GiB at 32B, H100, 2026-12-05). It
// counts the inputs it keeps then: a quarter of the limit holds 10 layers
// a backward stage (2 x 10 x 0.242 GiB with the next stage's), so the
// fewest are 7.
TEST(Planner, LayerFromStageKeepsTheFewestInputsBeforeTheirBytesAreMeasured) {
  const int64_t G = int64_t{1} << 30;
  std::vector<int64_t> bytes(66, static_cast<int64_t>(0.242 * G)), grads(66, 16 * kMiB);
  bytes[0] = bytes[65] = static_cast<int64_t>(1.449 * G);
  grads[0] = grads[65] = 0;
  PlanRequest request;
  request.fused = true;
  request.layer_grain = true;
  request.rerun_from_stage_input = true;
  request.memory_limit_bytes = static_cast<int64_t>(20.25 * G);
  request.activations_unmeasured = true;
  request.unmeasured_activation_share = 0.75;
  const auto thin = plan_stages(costs_from_bytes(bytes, grads), request);
  for (const auto& s : thin.stages) EXPECT_LE(s.peak_bytes, request.memory_limit_bytes / 4);
  EXPECT_EQ(thin.checkpoint_bytes, 0);
  EXPECT_LE(thin.checkpoint_inputs, 7) << thin.describe();
}

}  // namespace
}  // namespace roundpipe

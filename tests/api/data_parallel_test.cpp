// Data parallel over c10d (Gloo on loopback): 2 and 3 ranks, each a thread
// of this process with its own RoundPipe on simulated devices and its own
// share of every batch, train as one model on the whole batch would, with
// and without sharded optimizer state; sharded checkpoints resume with
// another number of ranks; a rank that fails makes the others fail with an
// error instead of hanging.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <roundpipe/checkpoint.h>
#include <roundpipe/distributed.h>
#include <roundpipe/optim/adam.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <functional>
#include <thread>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

constexpr int kSteps = 3;
constexpr int64_t kBatch = 12;  // divisible by 2 and 3 ranks
constexpr double kLr = 2e-2;

// Runs body(rank, group) on `world` threads, one process group each; returns
// each rank's error (null: none).
std::vector<std::exception_ptr> run_ranks(
    int world, std::chrono::milliseconds timeout,
    const std::function<void(int, const c10::intrusive_ptr<c10d::ProcessGroup>&)>& body) {
  const int port = free_port();
  std::vector<std::exception_ptr> errors(world);
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        LaunchEnvironment env;
        env.rank = rank;
        env.world_size = world;
        env.master_addr = "127.0.0.1";
        env.master_port = port;
        groups[rank] = new_gloo_group(env, "test", timeout);
        body(rank, groups[rank]);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  return {make_input(ModelKind::kMlp, kBatch, 700 + step),
          at::randn({kBatch, 4}, at::detail::createCPUGenerator(800 + step))};
}

// The mean squared error over `rows` rows (a process's share of the batch)
// as a sum over rows: a microbatch adds its rows' squared errors over
// `rows` x 4 outputs. The ranks' means, averaged, are the whole batch's.
LossFn sum_over(int64_t rows) {
  return [rows](const c10::IValue& out, const c10::IValue& label) {
    return (out.toTensor() - label.toTensor()).pow(2).sum() / static_cast<double>(rows * 4);
  };
}

enum class StepKind { kSyncStepFn, kFusedAsync, kFusedAsyncClipped };
const char* step_name(StepKind kind) {
  switch (kind) {
    case StepKind::kSyncStepFn:
      return "SyncStepFn";
    case StepKind::kFusedAsync:
      return "FusedAsync";
    case StepKind::kFusedAsyncClipped:
      return "FusedAsyncClipped";
  }
  return "?";
}

optim::AdamConfig adam_config() {
  return optim::AdamConfig().set_lr(kLr).set_weight_decay(0.01).set_eps(kAdamEps);
}

// Trains `model` through RoundPipe for kSteps on its rows of each batch
// (rank of world), data parallel over `group` when there is one; returns
// the weights after synchronize().
// `masters`: the elements of this rank's masters (sharded: its share).
std::vector<at::Tensor> train(torch::nn::Sequential model, StepKind kind, int rank, int world,
                              const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                              c10::ScalarType reduce_dtype = c10::kFloat,
                              std::vector<at::Tensor>* first_grads = nullptr, bool shard = false,
                              int64_t* masters = nullptr) {
  auto options = RoundPipeOptions().set_devices("sim:2,jitter_us=150");
  // Tiny buckets: several reductions in flight within one step.
  if (group) {
    options.set_data_parallel(DataParallelOptions(group)
                                  .set_bucket_bytes(300)
                                  .set_reduce_dtype(reduce_dtype)
                                  .set_shard_optimizer_state(shard));
  }
  RoundPipe pipe(model, options);
  if (masters != nullptr) {
    *masters = 0;
    for (const auto& m : pipe.optim_parameters()) *masters += m.numel();
  }
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  optim::GradClipper clip(0.05);  // below the gradients' norm: every step clips
  const int64_t share = kBatch / world;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    pipe.forward_backward(x.narrow(0, rank * share, share), y.narrow(0, rank * share, share),
                          sum_over(share));
    switch (kind) {
      case StepKind::kSyncStepFn:
        pipe.step(
            [&] {
              if (first_grads != nullptr && step == 0) {
                for (const auto& p : pipe.optim_parameters())
                  first_grads->push_back(p.grad().clone());
              }
              adam.step();
              adam.zero_grad();
            },
            /*is_async=*/false);
        break;
      case StepKind::kFusedAsync:
        pipe.step(adam);
        break;
      case StepKind::kFusedAsyncClipped:
        pipe.step(adam, /*is_async=*/true, nullptr, &clip);
        break;
    }
  }
  pipe.synchronize();
  std::vector<at::Tensor> weights;
  for (const auto& p : model->parameters()) weights.push_back(p.detach().clone());
  return weights;
}

// Plain LibTorch on the whole batch, the synchronous step's oracle.
std::vector<at::Tensor> train_plain() {
  auto model = make_model(ModelKind::kMlp);
  torch::optim::Adam adam(model->parameters(),
                          torch::optim::AdamOptions(kLr).weight_decay(0.01).eps(kAdamEps));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    auto loss = sum_over(kBatch)(model->forward(x), y);
    loss.backward();
    adam.step();
    adam.zero_grad();
  }
  std::vector<at::Tensor> weights;
  for (const auto& p : model->parameters()) weights.push_back(p.detach().clone());
  return weights;
}

// One model per rank, made here: make_model seeds the global generator,
// which the ranks' threads would share.
std::vector<torch::nn::Sequential> models_for(int world) {
  std::vector<torch::nn::Sequential> models;
  for (int rank = 0; rank < world; ++rank) models.push_back(make_model(ModelKind::kMlp));
  return models;
}

void rethrow_any(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

int64_t trainable_elements(const torch::nn::Sequential& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  return n;
}

class DataParallelTest : public ::testing::TestWithParam<std::tuple<int, StepKind, bool>> {};

TEST_P(DataParallelTest, RanksTrainAsOneProcessOnTheWholeBatch) {
  const auto [world, kind, shard] = GetParam();
  // The oracle: plain LibTorch for the synchronous step; for the
  // asynchronous ones (one update of staleness, tested against plain
  // LibTorch in training_loop_test), one RoundPipe on the whole batch.
  const auto expected = kind == StepKind::kSyncStepFn
                            ? train_plain()
                            : train(make_model(ModelKind::kMlp), kind, 0, 1, {});
  std::vector<std::vector<at::Tensor>> weights(world);
  std::vector<int64_t> masters(world);
  const auto models = models_for(world);
  rethrow_any(run_ranks(world, std::chrono::seconds(120), [&](int rank, const auto& group) {
    weights[rank] =
        train(models[rank], kind, rank, world, group, c10::kFloat, nullptr, shard, &masters[rank]);
  }));
  // Sharded: each rank keeps masters (and moments) for its share only, the
  // shares cover the model once and every rank has one.
  const int64_t total = trainable_elements(models[0]);
  int64_t kept = 0;
  for (int rank = 0; rank < world; ++rank) {
    kept += masters[rank];
    if (shard) {
      EXPECT_GT(masters[rank], 0) << "rank " << rank;
      EXPECT_LT(masters[rank], total) << "rank " << rank;
    } else {
      EXPECT_EQ(masters[rank], total) << "rank " << rank;
    }
  }
  EXPECT_EQ(kept, shard ? total : world * total);
  for (int rank = 0; rank < world; ++rank) {
    for (size_t i = 0; i < expected.size(); ++i) {
      // Adam on gradients that differ by rounding (test_util.h).
      EXPECT_TENSOR_ABS_NEAR(weights[rank][i], expected[i], adam_weight_tolerance(kSteps, kLr),
                             "rank " << rank << " of " << world << ", weight " << i);
      // Every rank runs the same update on the same averaged gradients.
      EXPECT_TRUE(at::equal(weights[rank][i], weights[0][i])) << "rank " << rank << " weight " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, DataParallelTest,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values(StepKind::kSyncStepFn,
                                                              StepKind::kFusedAsync,
                                                              StepKind::kFusedAsyncClipped),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "Ranks" +
                                  step_name(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "Sharded" : "");
                         });

// `options` with sharded optimizer state over `group` (when there is one)
// in small buckets.
RoundPipeOptions sharded_over(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                              RoundPipeOptions options) {
  if (group) {
    options.set_data_parallel(
        DataParallelOptions(group).set_bucket_bytes(300).set_shard_optimizer_state(true));
  }
  return options;
}

// Trains steps [from, to) of the whole run on this rank's rows, sharded
// when data parallel: loaded from `load` first and saved to `save` after
// (each when not empty); returns the weights after synchronize().
std::vector<at::Tensor> train_part(torch::nn::Sequential model, int rank, int world,
                                   const c10::intrusive_ptr<c10d::ProcessGroup>& group, int from,
                                   int to, const std::string& load, const std::string& save) {
  RoundPipe pipe(model, sharded_over(group, RoundPipeOptions().set_devices("sim:2,jitter_us=150")));
  optim::Adam adam(pipe.optim_parameters(), adam_config());
  StepsGuard steps_done_before_adam_goes(pipe);
  if (!load.empty()) load_checkpoint(load, pipe, &adam, nullptr);
  const int64_t share = kBatch / world;
  for (int step = from; step < to; ++step) {
    auto [x, y] = batch(step);
    pipe.forward_backward(x.narrow(0, rank * share, share), y.narrow(0, rank * share, share),
                          sum_over(share));
    pipe.step(adam);  // async: the checkpoint holds a pending update
  }
  if (!save.empty()) save_checkpoint(save, pipe, &adam, nullptr);
  pipe.synchronize();
  std::vector<at::Tensor> weights;
  for (const auto& p : model->parameters()) weights.push_back(p.detach().clone());
  return weights;
}

TEST(DataParallel, ShardedCheckpointsResumeWithAnotherNumberOfRanks) {
  // The uninterrupted run: one process, the whole batch, kSteps steps.
  const auto expected = train(make_model(ModelKind::kMlp), StepKind::kFusedAsync, 0, 1, {});
  const auto dir = process_temp_dir() / "sharded_checkpoints";
  std::filesystem::remove_all(dir);
  const std::string first = (dir / "by-2").string(), second = (dir / "by-3").string();
  // 2 ranks train step 0 and write a checkpoint of one share each...
  auto models = models_for(2);
  rethrow_any(run_ranks(2, std::chrono::seconds(120), [&](int rank, const auto& group) {
    train_part(models[rank], rank, 2, group, 0, 1, "", first);
  }));
  EXPECT_TRUE(std::filesystem::exists(first + "/master-rank00001-of-00002.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(first + "/master.safetensors"));
  // ...3 ranks resume it for step 1 and write theirs...
  models = models_for(3);
  std::vector<std::vector<at::Tensor>> weights(3);
  rethrow_any(run_ranks(3, std::chrono::seconds(120), [&](int rank, const auto& group) {
    train_part(models[rank], rank, 3, group, 1, 2, first, second);
  }));
  EXPECT_TRUE(std::filesystem::exists(second + "/optimizer-rank00002-of-00003.safetensors"));
  // ...and one process without data parallel reads the 3 shares for the
  // last step.
  const auto resumed = train_part(make_model(ModelKind::kMlp), 0, 1, {}, 2, kSteps, second, "");
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TENSOR_ABS_NEAR(resumed[i], expected[i], adam_weight_tolerance(kSteps, kLr),
                           "weight " << i);
  }
}

// The model's dtype on the wire: bfloat16 weights, float32 masters. Every
// rank ends with the owners' bytes, and the run follows one process's.
TEST(DataParallel, ShardedBfloat16WeightsWithFloat32Masters) {
  constexpr int world = 2;
  auto run = [&](torch::nn::Sequential model, int rank, int w,
                 const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    model->to(c10::kBFloat16);
    RoundPipe pipe(
        model,
        sharded_over(group, RoundPipeOptions().set_devices("sim:1").set_optim_dtype(c10::kFloat)));
    optim::Adam adam(pipe.optim_parameters(), adam_config());
    StepsGuard steps_done_before_adam_goes(pipe);
    const int64_t share = kBatch / w;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      pipe.forward_backward(x.narrow(0, rank * share, share).to(c10::kBFloat16),
                            y.narrow(0, rank * share, share).to(c10::kBFloat16), sum_over(share));
      pipe.step(adam, /*is_async=*/step % 2 == 0);
    }
    pipe.synchronize();
    std::vector<at::Tensor> weights;
    for (const auto& p : model->parameters()) weights.push_back(p.detach().to(c10::kFloat));
    return weights;
  };
  const auto expected = run(make_model(ModelKind::kMlp), 0, 1, {});
  std::vector<std::vector<at::Tensor>> weights(world);
  const auto models = models_for(world);
  rethrow_any(run_ranks(world, std::chrono::seconds(120), [&](int rank, const auto& group) {
    weights[rank] = run(models[rank], rank, world, group);
  }));
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(at::equal(weights[1][i], weights[0][i])) << "weight " << i;
    // Gradients from bf16 activations added in another order: a few bf16
    // roundings of the weight per step on top of Adam's bound.
    const double bound = adam_weight_tolerance(kSteps, kLr) +
                         kSteps * std::ldexp(1.0, -7) * expected[i].abs().max().item<double>();
    EXPECT_TENSOR_ABS_NEAR(weights[0][i], expected[i], bound, "weight " << i);
  }
}

TEST(DataParallel, Bfloat16ReductionIsWithinItsRounding) {
  constexpr int world = 3;
  std::vector<at::Tensor> exact;
  train(make_model(ModelKind::kMlp), StepKind::kSyncStepFn, 0, 1, {}, c10::kFloat, &exact);
  std::vector<std::vector<at::Tensor>> grads(world);
  const auto models = models_for(world);
  rethrow_any(run_ranks(world, std::chrono::seconds(120), [&](int rank, const auto& group) {
    train(models[rank], StepKind::kSyncStepFn, rank, world, group, c10::kBFloat16, &grads[rank]);
  }));
  for (size_t i = 0; i < exact.size(); ++i) {
    // Each rank's gradient (world x its share of the mean) rounded to bf16
    // (2^-9 relative), their sum rounded at each of world - 1 additions:
    // within 2^-9 (world x max|g| x (1 + world)) / world. Twice that.
    const double bound =
        std::ldexp(1.0, -8) * (1 + world) * exact[i].abs().max().item<double>() * world;
    EXPECT_TENSOR_ABS_NEAR(grads[0][i], exact[i], bound, "gradient " << i);
    EXPECT_GT((grads[0][i] - exact[i]).abs().max().item<double>(), 0)
        << "gradient " << i << ": bf16 on the wire must round something";
  }
}

class DataParallelFailureTest : public ::testing::TestWithParam<bool> {};

TEST_P(DataParallelFailureTest, ARankThatFailsMakesTheOthersFailInsteadOfHanging) {
  const bool shard = GetParam();
  const auto start = std::chrono::steady_clock::now();
  const auto models = models_for(2);
  // (The group's timeout bounds every collective, the rendezvous and step 0's
  // averaging too: 10 s, so that a rank starved on a loaded machine does not
  // fail before the step meant to.)
  const auto errors = run_ranks(2, std::chrono::seconds(10), [&](int rank, const auto& group) {
    RoundPipe pipe(models[rank], RoundPipeOptions().set_devices("sim:1").set_data_parallel(
                                     DataParallelOptions(group).set_shard_optimizer_state(shard)));
    optim::Adam adam(pipe.optim_parameters(), adam_config());
    StepsGuard steps_done_before_adam_goes(pipe);  // this loop ends by an exception
    auto [x, y] = batch(0);
    for (int step = 0; step < kSteps; ++step) {
      pipe.forward_backward(x, y, [&](const c10::IValue& out, const c10::IValue& label) {
        TORCH_CHECK(!(rank == 1 && step == 1), "rank 1 fails at step 1");
        return mse_loss(out, label);
      });
      pipe.step(adam);
    }
    pipe.synchronize();
  });
  ASSERT_TRUE(errors[1]);
  EXPECT_HAS(message_of([&] { std::rethrow_exception(errors[1]); }), "rank 1 fails at step 1");
  ASSERT_TRUE(errors[0]) << "rank 0 finished although rank 1 stopped";
  const auto error = message_of([&] { std::rethrow_exception(errors[0]); });
  EXPECT_HAS(error, "data parallel: averaging gradient bucket");
  EXPECT_HAS(error, "Another process most likely stopped");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

INSTANTIATE_TEST_SUITE_P(DataParallel, DataParallelFailureTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Sharded" : "Replicated"; });

TEST(DataParallel, RanksThatStartFromDifferentWeightsAreRefused) {
  std::vector<torch::nn::Sequential> models{make_model(ModelKind::kMlp, 1),
                                            make_model(ModelKind::kMlp, 2)};
  const auto errors = run_ranks(2, std::chrono::seconds(60), [&](int rank, const auto& group) {
    RoundPipe pipe(models[rank], RoundPipeOptions().set_devices("sim:1").set_data_parallel(
                                     DataParallelOptions(group)));
    optim::Adam adam(pipe.optim_parameters(), adam_config());
    StepsGuard steps_done_before_adam_goes(pipe);
    auto [x, y] = batch(0);
    pipe.forward_backward(x, y, mse_loss);
    pipe.step(adam, /*is_async=*/false);
  });
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(errors[rank]) << "rank " << rank << " trained from different weights";
    const auto error = message_of([&] { std::rethrow_exception(errors[rank]); });
    EXPECT_HAS(error, "processes start from different weights (0.weight differs first");
    EXPECT_HAS(error, "seed every process alike");
  }
}

TEST(DataParallel, OptionsAreChecked) {
  EXPECT_HAS(message_of([] { DataParallelOptions options{{}}; }), "needs a process group");
}

}  // namespace
}  // namespace roundpipe::testing

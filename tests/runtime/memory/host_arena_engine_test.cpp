// The engine's use of the host arena (runtime/memory/host_arena.h):
// pin_model=alloc places the model in one exact chunk and reuses download
// blocks, a call's layer inputs go back with its backward, idle chunks go
// back, shared storages stay shared; register and off leave it empty. On
// simulated devices the arena runs unpinned; on GPUs, pinned.
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "runtime/memory/host_arena.h"
#include "test_util.h"

namespace roundpipe::testing {
namespace {

torch::nn::Sequential odd_sized_model() {
  torch::manual_seed(7);
  namespace nn = torch::nn;
  // Sizes that are no powers of two: a power-of-two allocator would take
  // 7% more for them.
  return nn::Sequential(nn::Linear(96, 80), nn::Tanh(), nn::Linear(80, 96), nn::Tanh(),
                        nn::Linear(96, 80), nn::Tanh(), nn::Linear(80, 96), nn::Tanh(),
                        nn::Linear(96, 4));
}

int64_t parameter_bytes(torch::nn::Sequential& model) {
  int64_t bytes = 0;
  for (const auto& p : model->parameters()) bytes += p.nbytes();
  return bytes;
}

// The last call's downloads may be dropped by a worker thread just after
// synchronize() returns: waits (bounded) until `live` blocks remain.
HostMemoryStats settled(const RoundPipe& pipe, int64_t live) {
  auto s = pipe.host_memory_stats();
  for (int i = 0; i < 1000 && s.arena.live_blocks != live; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    s = pipe.host_memory_stats();
  }
  return s;
}

// sim:2, and the GPUs when there are any (pinned there).
std::vector<std::string> arena_backends() {
  std::vector<std::string> specs = {"sim:2"};
  if (cuda_device_count() > 0) specs.push_back("cuda");
  return specs;
}

// 6 -> width -> width -> width -> 4, tanh between: three hidden layers'
// inputs of `width` a row.
torch::nn::Sequential seven_layers(int64_t width) {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Linear(6, width), nn::Tanh(), nn::Linear(width, width), nn::Tanh(),
                        nn::Linear(width, width), nn::Tanh(), nn::Linear(width, 4));
}

// The model in the arena (pin_model=alloc) on `devices`, planned within
// `limit_bytes`.
RoundPipeOptions arena_options(const std::string& devices, double limit_bytes) {
  return RoundPipeOptions()
      .set_devices(devices)
      .set_pin_model(PinMode::kAlloc)
      .set_model_memory_limit_gib(limit_bytes / (1 << 30));
}

class HostArenaEngineTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HostArenaEngineTest, AllocModePlacesTheModelInOneExactChunkAndReusesDownloads) {
  const bool pinned = GetParam().rfind("cuda", 0) == 0;
  auto model = odd_sized_model();
  const int64_t model_bytes = parameter_bytes(model);
  std::vector<const void*> before;
  for (const auto& p : model->parameters()) before.push_back(p.data_ptr());
  RoundPipe pipe(model, RoundPipeOptions().set_devices(GetParam()).set_pin_model(PinMode::kAlloc));
  const auto placed = pipe.host_memory_stats();
  EXPECT_EQ(placed.model_state_bytes, model_bytes);
  EXPECT_EQ(placed.arena.chunks, 1);
  EXPECT_EQ(placed.arena.allocated_bytes, placed.arena.reserved_bytes);
  EXPECT_EQ(placed.arena.live_blocks, static_cast<int64_t>(model->parameters().size()));
  // Simulated devices: the arena runs unpinned.
  EXPECT_EQ(placed.arena.pinned_bytes, pinned ? placed.arena.reserved_bytes : 0);
  EXPECT_LE(static_cast<double>(placed.arena.reserved_bytes) / placed.model_state_bytes, 1.05);
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_NE(params[i].data_ptr(), before[i]) << "parameter " << i << " was not moved";
    if (pinned) EXPECT_TRUE(params[i].is_pinned()) << "parameter " << i;
  }

  optim::Adam adam(pipe.optim_parameters(), optim::AdamConfig().set_lr(1e-3));
  auto x = at::randn({12, 96}, at::detail::createCPUGenerator(1));
  auto y = at::randn({12, 4}, at::detail::createCPUGenerator(2));
  auto config = RunConfig().set_num_microbatch(3);
  auto train = [&](int steps) {
    for (int i = 0; i < steps; ++i) {
      pipe.forward_backward(x, y, mse_loss, false, config);
      pipe.step(adam, /*is_async=*/true);
    }
    pipe.synchronize();
  };
  // Between steps only the homes and the fused step's staging copies (one
  // per parameter, the homes' sizes) stay: every download went back.
  const int64_t steady_blocks = 2 * placed.arena.live_blocks;
  train(3);
  const auto warm = settled(pipe, steady_blocks);
  EXPECT_EQ(warm.arena.live_blocks, steady_blocks);
  EXPECT_EQ(warm.arena.allocated_bytes, 2 * placed.arena.allocated_bytes);
  // Downloads and staging copies came from the arena: a chunk beyond the
  // parameters' one, and more allocated at the peak than the two copies.
  EXPECT_GE(warm.arena.chunks, 2);
  EXPECT_GT(warm.arena.peak_allocated_bytes, 2 * placed.arena.allocated_bytes);
  train(50);
  const auto after = settled(pipe, steady_blocks);
  // (Never more; chunks only the first calls took may have gone back: Note
  // [Idle arena chunks go back].)
  EXPECT_LE(after.arena.reserved_bytes, warm.arena.reserved_bytes);
  EXPECT_LE(after.arena.chunks, warm.arena.chunks);
  EXPECT_EQ(after.arena.live_blocks, steady_blocks);
  EXPECT_EQ(after.arena.allocated_bytes, 2 * placed.arena.allocated_bytes);
  EXPECT_EQ(after.model_state_bytes, model_bytes);
  EXPECT_EQ(after.arena.pinned_bytes, pinned ? after.arena.reserved_bytes : 0);
}

// Note [Hand-offs end with their last reader]: a call's layer inputs go
// back to the arena as its backward stages finish with them, not when a
// step takes the call's gradients. Held to the step, every call of an
// accumulation kept its own (and the next call's forward beside an
// asynchronous step found the previous call's still there).
TEST_P(HostArenaEngineTest, ACallsLayerInputsGoBackWithItsBackward) {
  const int64_t rows = 4096, width = 12;
  const int64_t layer_input = rows * width * 4;  // a hidden layer's input, all microbatches
  auto x = at::randn({rows, 6}, at::detail::createCPUGenerator(11));
  auto y = at::randn({rows, 4}, at::detail::createCPUGenerator(12));
  for (auto grain :
       {RecomputeGrain::kLayer, RecomputeGrain::kStage, RecomputeGrain::kLayerFromStage}) {
    SCOPED_TRACE(to_string(grain));
    torch::manual_seed(3);
    // A limit of two or three layers' activations: several stages, whose
    // inputs (4096 rows) dwarf the weights.
    RoundPipe pipe(seven_layers(width), arena_options(GetParam(), 6e5));
    const int64_t placed = pipe.host_memory_stats().arena.allocated_bytes;
    const auto config = RunConfig().set_num_microbatch(2).set_recompute_grain(grain);
    for (int call = 1; call <= 3; ++call) {
      pipe.forward_backward(x, y, mse_loss, false, config);
      pipe.wait_for_background_work();  // its backward done; no step took it
      const auto s = pipe.host_memory_stats().arena;
      ASSERT_GT(s.peak_allocated_bytes - placed, layer_input)
          << "the call saved no stage inputs in the arena";
      // What stays: each call's parameter gradients (a few KiB), no input.
      EXPECT_LT(s.allocated_bytes - placed, layer_input / 4)
          << "after call " << call << ", its layer inputs are still held";
    }
    pipe.synchronize();
  }
}

// Note [Idle arena chunks go back]: after a call that kept large layer
// inputs on the host, calls that need less return the chunks it took (at
// the start of the second call after the last that used them).
TEST_P(HostArenaEngineTest, ChunksALargerCallTookGoBackWhenLaterCallsNeedLess) {
  const int64_t width = 64, large_rows = 16384;
  const int64_t layer_input = large_rows * width * 4;  // 4 MiB, above the 2 MiB chunks
  torch::manual_seed(5);
  RoundPipe pipe(seven_layers(width), arena_options(GetParam(), 12e6));
  const auto config = RunConfig().set_num_microbatch(2).set_recompute_grain(RecomputeGrain::kLayer);
  auto call = [&](int64_t rows) {
    pipe.forward_backward(at::randn({rows, 6}), at::randn({rows, 4}), mse_loss, false, config);
    pipe.wait_for_background_work();
  };
  call(large_rows);
  const auto large = pipe.host_memory_stats().arena;
  ASSERT_GE(large.reserved_bytes - pipe.host_memory_stats().model_state_bytes, layer_input)
      << "the large call kept no layer input in the arena";
  for (int i = 0; i < 3; ++i) call(64);
  const auto small = pipe.host_memory_stats().arena;
  EXPECT_LE(small.reserved_bytes, large.reserved_bytes - layer_input);
  EXPECT_LT(small.chunks, large.chunks);
  call(large_rows);  // and a large call again finds room
  pipe.synchronize();
}

INSTANTIATE_TEST_SUITE_P(Backends, HostArenaEngineTest, ::testing::ValuesIn(arena_backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

// Two parameters that are views of one storage.
struct TwoViewsImpl : torch::nn::Cloneable<TwoViewsImpl> {
  at::Tensor first, second;
  TwoViewsImpl() { reset(); }
  void reset() override {
    auto base = at::randn({2, 64});
    first = register_parameter("first", base[0]);
    second = register_parameter("second", base[1]);
  }
  at::Tensor forward(at::Tensor x) { return x * first + second; }
};
TORCH_MODULE(TwoViews);

TEST(HostArenaEngine, SharedStoragesArePlacedOnceAndStayShared) {
  // A tied weight is one parameter: its bytes count once.
  auto model = make_model(ModelKind::kTied);
  std::set<const c10::TensorImpl*> seen;
  int64_t unique_bytes = 0;
  for (const auto& p : model->parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) unique_bytes += p.nbytes();
  }
  ASSERT_LT(seen.size(), model->parameters().size()) << "the model has no tie";
  RoundPipe tied(model, RoundPipeOptions().set_devices("sim:2"));
  EXPECT_EQ(tied.host_memory_stats().model_state_bytes, unique_bytes);
  EXPECT_EQ(tied.host_memory_stats().arena.live_blocks, static_cast<int64_t>(seen.size()));

  // Views of one storage stay views of one block.
  torch::manual_seed(3);
  TwoViews views;
  const auto expected_first = views->first.detach().clone();
  const auto expected_second = views->second.detach().clone();
  const void* old_storage = views->first.storage().data();
  RoundPipe shared(torch::nn::Sequential(views), RoundPipeOptions().set_devices("sim:1"));
  const auto& first = views->first;
  const auto& second = views->second;
  EXPECT_NE(first.storage().data(), old_storage);
  EXPECT_EQ(first.storage().data(), second.storage().data());
  EXPECT_EQ(second.storage_offset() - first.storage_offset(), 64);
  EXPECT_TRUE(first.equal(expected_first));
  EXPECT_TRUE(second.equal(expected_second));
  const auto s = shared.host_memory_stats();
  EXPECT_EQ(s.model_state_bytes, 2 * 64 * 4);
  EXPECT_EQ(s.arena.live_blocks, 1);
  EXPECT_EQ(s.arena.reserved_bytes, 512);
  // It trains: the gradient of x * first + second.
  auto x = at::randn({4, 64}, at::detail::createCPUGenerator(5));
  auto out = shared.forward(x);
  out.sum().backward();
  shared.synchronize();
  EXPECT_TENSOR_NEAR(first.grad(), x.sum(0), 1e-5, "gradient of first");
  EXPECT_TENSOR_NEAR(second.grad(), at::full({64}, 4.0), 1e-5, "gradient of second");
}

TEST(HostArenaEngine, RegisterAndOffLeaveTheArenaEmpty) {
  for (auto mode : {PinMode::kRegister, PinMode::kOff}) {
    auto model = odd_sized_model();
    std::vector<const void*> before;
    for (const auto& p : model->parameters()) before.push_back(p.data_ptr());
    RoundPipe pipe(model, RoundPipeOptions().set_devices("sim:2").set_pin_model(mode));
    auto x = at::randn({6, 96}, at::detail::createCPUGenerator(1));
    auto y = at::randn({6, 4}, at::detail::createCPUGenerator(2));
    pipe.forward_backward(x, y, mse_loss);
    pipe.synchronize();
    const auto s = pipe.host_memory_stats();
    EXPECT_EQ(s.arena.chunks, 0);
    EXPECT_EQ(s.arena.peak_allocated_bytes, 0);
    EXPECT_EQ(s.model_state_bytes, parameter_bytes(model));
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(params[i].data_ptr(), before[i]);
  }
}

}  // namespace
}  // namespace roundpipe::testing

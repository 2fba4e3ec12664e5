// HostArena: exact sizes, reuse, coalescing, no leaks under concurrent use,
// blocks outliving the arena; and the engine's use of it (pin_model=alloc on
// simulated devices, where the arena runs unpinned).
#include "runtime/memory/host_arena.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

constexpr int64_t kKiB = 1024;

uintptr_t address(const c10::DataPtr& p) {
  return reinterpret_cast<uintptr_t>(p.get());
}

// Runs `fn`, which must throw a c10::Error whose message contains `what`.
template <typename Fn>
void expect_error(Fn fn, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one saying '" << what << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(what), std::string::npos)
        << e.what_without_backtrace();
  }
}

// A host allocation that fails is the host's error, never the device's
// out-of-memory error (which would make the automatic plan smaller).
TEST(HostArena, AHostThatIsOutOfMemoryIsNotADeviceOutOfMemory) {
  HostArena arena(HostArenaOptions().set_chunk_bytes(kKiB * kKiB));
  try {
    arena.allocate(int64_t{1} << 55);  // 32 PiB
    ADD_FAILURE() << "no error";
  } catch (const c10::OutOfMemoryError& e) {
    ADD_FAILURE() << "a device out-of-memory error: " << e.what_without_backtrace();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("host is out of memory"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_EQ(arena.allocate(1000).get() != nullptr, true);  // still usable
}

TEST(HostArena, BlocksAreTheirRequestRoundedToTheAlignment) {
  HostArena arena(HostArenaOptions().set_chunk_bytes(kKiB * kKiB).set_alignment(512));
  std::vector<c10::DataPtr> blocks;
  int64_t expected = 0;
  for (int64_t bytes : {1000, 512, 1, 5000, 70001}) {
    blocks.push_back(arena.allocate(bytes));
    expected += (bytes + 511) / 512 * 512;  // 5000 takes 5120, not 8192
    EXPECT_EQ(address(blocks.back()) % 512, 0u) << bytes << " bytes";
    EXPECT_EQ(arena.stats().allocated_bytes, expected) << "after " << bytes << " bytes";
  }
  auto t = arena.empty({3, 5}, at::kFloat);  // 60 bytes
  expected += 512;
  EXPECT_EQ(t.sizes(), at::IntArrayRef({3, 5}));
  EXPECT_EQ(t.scalar_type(), at::kFloat);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(t.device().is_cpu());
  t.fill_(2.5);
  EXPECT_EQ(t.sum().item<float>(), 37.5f);
  const auto s = arena.stats();
  EXPECT_EQ(s.allocated_bytes, expected);
  EXPECT_EQ(s.peak_allocated_bytes, expected);
  EXPECT_EQ(s.live_blocks, 6);
  EXPECT_EQ(s.chunks, 1);
  EXPECT_EQ(s.reserved_bytes, kKiB * kKiB);
  EXPECT_EQ(s.pinned_bytes, 0);  // pin not asked for
  EXPECT_EQ(arena.block_bytes(5000), 5120);
  EXPECT_EQ(arena.block_bytes(0), 0);
}

TEST(HostArena, AReservedChunkFilledExactlyIsAllAllocated) {
  HostArena arena(HostArenaOptions().set_chunk_bytes(kKiB * kKiB));
  const std::vector<int64_t> sizes = {1000, 3000, 512, 7, 65536 + 3};
  int64_t total = 0;
  for (auto bytes : sizes) total += arena.block_bytes(bytes);
  arena.reserve(total);
  EXPECT_EQ(arena.stats().reserved_bytes, total);
  std::vector<c10::DataPtr> blocks;
  for (auto bytes : sizes) blocks.push_back(arena.allocate(bytes));
  auto s = arena.stats();
  EXPECT_EQ(s.chunks, 1);
  EXPECT_EQ(s.reserved_bytes, total);
  EXPECT_EQ(s.allocated_bytes, s.reserved_bytes);
  // Full: the next block takes a chunk of chunk_bytes.
  blocks.push_back(arena.allocate(1));
  s = arena.stats();
  EXPECT_EQ(s.chunks, 2);
  EXPECT_EQ(s.reserved_bytes, total + kKiB * kKiB);
  // reserve() rounds only to the alignment; a request larger than
  // chunk_bytes gets a chunk of its own size.
  arena.reserve(5000);
  EXPECT_EQ(arena.stats().reserved_bytes, total + kKiB * kKiB + 5120);
  blocks.push_back(arena.allocate(3 * kKiB * kKiB + 1));
  EXPECT_EQ(arena.stats().reserved_bytes, total + 4 * kKiB * kKiB + 5120 + 512);
}

TEST(HostArena, AFreedBlockIsReusedAtTheSameAddress) {
  HostArena arena(HostArenaOptions().set_chunk_bytes(kKiB * kKiB));
  auto a = arena.allocate(4096), b = arena.allocate(2048), c = arena.allocate(4096);
  const auto b_at = address(b);
  b.clear();
  EXPECT_EQ(arena.stats().live_blocks, 2);
  auto again = arena.allocate(2000);  // best fit: b's hole, not the chunk's tail
  EXPECT_EQ(address(again), b_at);
  // Tensors: a freed storage's block comes back for the same size.
  auto t = arena.empty({100, 3}, at::kDouble);
  const auto t_at = t.data_ptr();
  const auto reserved = arena.stats().reserved_bytes;
  t = at::Tensor();
  for (int i = 0; i < 10; ++i) {
    auto u = arena.empty({100, 3}, at::kDouble);
    EXPECT_EQ(u.data_ptr(), t_at) << "iteration " << i;
  }
  EXPECT_EQ(arena.stats().reserved_bytes, reserved);
  EXPECT_EQ(arena.stats().chunks, 1);
}

TEST(HostArena, FreedNeighboursServeOneLargerRequest) {
  // Free order: a then b (b joins its free predecessor), b then a (a joins
  // its free successor), and a, c, then b (b joins both).
  for (int order = 0; order < 3; ++order) {
    HostArena arena(HostArenaOptions().set_chunk_bytes(kKiB * kKiB));
    arena.reserve(3 * 4096);
    auto a = arena.allocate(4096), b = arena.allocate(4096), c = arena.allocate(4096);
    ASSERT_EQ(arena.stats().chunks, 1);
    const auto a_at = address(a);
    if (order == 0) {
      a.clear();
      b.clear();
    } else if (order == 1) {
      b.clear();
      a.clear();
    } else {
      a.clear();
      c.clear();
      b.clear();
    }
    auto big = arena.allocate(order == 2 ? 3 * 4096 : 2 * 4096);
    EXPECT_EQ(address(big), a_at) << "order " << order;
    const auto s = arena.stats();
    EXPECT_EQ(s.chunks, 1) << "order " << order << ": the freed neighbours were not merged";
    EXPECT_EQ(s.reserved_bytes, 3 * 4096) << "order " << order;
  }
}

TEST(HostArena, ARepeatedPatternReachesASteadyState) {
  HostArena arena(HostArenaOptions().set_chunk_bytes(256 * kKiB));
  const std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> pattern = {
      {{300}, at::kByte},        {{70000}, at::kFloat}, {{32, 32}, at::kHalf},
      {{123457}, at::kBFloat16}, {{9}, at::kDouble},    {{500, 3}, at::kFloat}};
  int64_t reserved_after_first = 0;
  for (int i = 0; i < 1000; ++i) {
    std::vector<at::Tensor> live;
    for (const auto& [sizes, dtype] : pattern) live.push_back(arena.empty(sizes, dtype));
    // Free in another order than allocated.
    for (size_t k : {size_t{3}, size_t{0}, size_t{5}, size_t{1}, size_t{4}, size_t{2}})
      live[k] = at::Tensor();
    if (i == 0) reserved_after_first = arena.stats().reserved_bytes;
    ASSERT_EQ(arena.stats().reserved_bytes, reserved_after_first) << "iteration " << i;
  }
  const auto s = arena.stats();
  EXPECT_EQ(s.live_blocks, 0);
  EXPECT_EQ(s.allocated_bytes, 0);
}

// Note [Idle arena chunks go back]: a chunk entirely free and untouched
// through `passes` release passes goes back; one a block was taken from
// since the last pass, or one holding a block, stays.
TEST(HostArena, IdleChunksGoBackAfterTheirPassesAndUsedOnesStay) {
  constexpr int64_t kChunk = 64 * kKiB;
  HostArena arena(HostArenaOptions().set_chunk_bytes(kChunk));
  auto held = arena.allocate(kChunk);  // chunk 1, held throughout
  auto b = arena.allocate(kChunk), c = arena.allocate(kChunk);
  ASSERT_EQ(arena.stats().chunks, 3);
  b = c10::DataPtr();
  c = c10::DataPtr();
  EXPECT_EQ(arena.release_idle_chunks(2), 0);  // taken since no pass
  EXPECT_EQ(arena.release_idle_chunks(2), 0);  // one idle pass each
  auto again = arena.allocate(kChunk);         // one of the two is taken again
  again = c10::DataPtr();
  EXPECT_EQ(arena.release_idle_chunks(2), kChunk);  // the other: its second idle pass
  EXPECT_EQ(arena.stats().chunks, 2);
  EXPECT_EQ(arena.stats().reserved_bytes, 2 * kChunk);
  EXPECT_EQ(arena.release_idle_chunks(2), 0);
  EXPECT_EQ(arena.release_idle_chunks(2), kChunk);
  const auto s = arena.stats();
  EXPECT_EQ(s.chunks, 1);  // the held block's
  EXPECT_EQ(s.reserved_bytes, kChunk);
  EXPECT_EQ(s.allocated_bytes, kChunk);
  EXPECT_EQ(arena.release_idle_chunks(1), 0);
  auto after = arena.allocate(100);  // a new chunk
  EXPECT_NE(after.get(), nullptr);
  EXPECT_EQ(arena.stats().chunks, 2);
  EXPECT_THROW(arena.release_idle_chunks(0), c10::Error);
}

// Note [Pinned chunks go back off the caller's thread]: the released
// chunks leave the accounting at once and are freed on the releaser's
// thread; the arena stays usable meanwhile, and an arena destroyed with
// chunks still queued frees them before it goes.
TEST(HostArena, ReleasedChunksAreFreedOffTheCallersThread) {
  constexpr int64_t kChunk = 256 * kKiB;
  for (int round = 0; round < 20; ++round) {
    HostArena arena(HostArenaOptions().set_chunk_bytes(kChunk));
    std::vector<c10::DataPtr> blocks;
    for (int i = 0; i < 8; ++i) blocks.push_back(arena.allocate(kChunk));
    blocks.clear();
    EXPECT_EQ(arena.release_idle_chunks(1), 0);  // taken since the last pass
    EXPECT_EQ(arena.release_idle_chunks(1), 8 * kChunk);
    const auto s = arena.stats();
    EXPECT_EQ(s.chunks, 0);
    EXPECT_EQ(s.reserved_bytes, 0);
    auto again = arena.allocate(kChunk);  // a new chunk while the old ones are freed
    ASSERT_NE(again.get(), nullptr);
    static_cast<char*>(again.get())[kChunk - 1] = 1;
    EXPECT_EQ(arena.stats().chunks, 1);
    again = c10::DataPtr();
    EXPECT_EQ(arena.release_idle_chunks(1), 0);
    if (round % 2 == 0) EXPECT_EQ(arena.release_idle_chunks(1), kChunk);
    // destroyed here, with chunks maybe still queued
  }
}

TEST(HostArena, ConcurrentMixedSizesLeakNothing) {
  constexpr int64_t kChunk = kKiB * kKiB;
  HostArena arena(HostArenaOptions().set_chunk_bytes(kChunk));
  constexpr int kThreads = 4, kSlots = 8, kIterations = 1000;
  constexpr int64_t kMaxBytes = 64 * kKiB;
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      std::vector<at::Tensor> slots(kSlots);
      std::vector<uint8_t> marks(kSlots);
      for (int i = 0; i < kIterations; ++i) {
        const int k = static_cast<int>(rng() % kSlots);
        if (slots[k].defined()) {
          // A block handed out twice would have been overwritten by its
          // other owner.
          if (!slots[k].eq(marks[k]).all().item<bool>()) ++corrupted;
        }
        const int64_t bytes = 1 + static_cast<int64_t>(rng() % kMaxBytes);
        const bool wide = rng() % 2 == 0;
        slots[k] =
            wide ? arena.empty({(bytes + 3) / 4}, at::kInt) : arena.empty({bytes}, at::kByte);
        marks[k] = static_cast<uint8_t>(t * kSlots + k + 1);
        if (wide) {
          slots[k].fill_(static_cast<int32_t>(marks[k]) * 0x01010101);
          slots[k] = slots[k].view(at::kByte);
        } else {
          slots[k].fill_(marks[k]);
        }
      }
      for (int k = 0; k < kSlots; ++k) {
        if (slots[k].defined() && !slots[k].eq(marks[k]).all().item<bool>()) ++corrupted;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(corrupted.load(), 0);
  auto s = arena.stats();
  EXPECT_EQ(s.live_blocks, 0);
  EXPECT_EQ(s.allocated_bytes, 0);
  // At most kThreads * kSlots blocks of <= 64 KiB were live at once (2 MiB).
  EXPECT_LE(s.peak_allocated_bytes, kThreads * kSlots * kMaxBytes);
  EXPECT_LE(s.reserved_bytes, 4 * kThreads * kSlots * kMaxBytes);
  // Every chunk is one free block again: a chunk-sized block per chunk fits
  // without a new chunk.
  std::vector<c10::DataPtr> whole;
  for (int64_t c = 0; c < s.chunks; ++c) whole.push_back(arena.allocate(kChunk));
  EXPECT_EQ(arena.stats().chunks, s.chunks);
  EXPECT_EQ(arena.stats().reserved_bytes, s.reserved_bytes);
}

TEST(HostArena, TensorsOutliveTheArena) {
  auto arena = std::make_unique<HostArena>(HostArenaOptions().set_chunk_bytes(64 * kKiB));
  auto t = arena->empty({1000}, at::kDouble);  // in a 64 KiB chunk
  auto u = arena->empty({50000}, at::kFloat);  // a chunk of its own
  t.copy_(at::arange(1000, at::kDouble));
  u.fill_(1.0f);
  auto view = t.narrow(0, 10, 5);
  arena.reset();
  EXPECT_EQ(t.sum().item<double>(), 999.0 * 1000 / 2);
  EXPECT_EQ(u.sum().item<float>(), 50000.0f);
  EXPECT_EQ(view[0].item<double>(), 10.0);
  t.mul_(2);
  EXPECT_EQ(view[4].item<double>(), 28.0);
  t = at::Tensor();
  EXPECT_EQ(view[1].item<double>(), 22.0);  // the storage lives while a view does
}

// pin: chunks registered with the driver where there is a GPU, pageable
// (and working the same) where there is none.
TEST(HostArena, PinsItsChunksWhereAGpuIsVisible) {
  const bool gpu = cuda_device_count() > 0;
  HostArena arena(HostArenaOptions().set_chunk_bytes(kKiB * kKiB).set_pin(true));
  auto t = arena.empty({1000}, at::kFloat);
  arena.reserve(3000);
  const auto s = arena.stats();
  EXPECT_EQ(s.pinned_bytes, gpu ? s.reserved_bytes : 0);
  if (!gpu) return;
  // (is_pinned() answers false until LibTorch has initialised CUDA: a CUDA
  // tensor first.)
  auto on_gpu = at::arange(1000, at::kFloat).to(c10::Device(c10::kCUDA, 0));
  EXPECT_TRUE(t.is_pinned());
  t.copy_(on_gpu, /*non_blocking=*/true);
  (void)on_gpu.sum().item<float>();  // waits for the stream the copy ran on
  EXPECT_TRUE(t.equal(at::arange(1000, at::kFloat)));
}

TEST(HostArena, EmptyTensorsTakeNoBlock) {
  HostArena arena;
  auto t = arena.empty({0, 5}, at::kFloat);
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.sizes(), at::IntArrayRef({0, 5}));
  auto p = arena.allocate(0);
  EXPECT_EQ(p.get(), nullptr);
  arena.reserve(0);
  const auto s = arena.stats();
  EXPECT_EQ(s.live_blocks, 0);
  EXPECT_EQ(s.chunks, 0);
}

TEST(HostArena, BadInputIsRefusedWithAMessage) {
  expect_error([] { HostArena a(HostArenaOptions().set_alignment(0)); }, "power of two");
  expect_error([] { HostArena a(HostArenaOptions().set_alignment(48)); }, "power of two");
  expect_error([] { HostArena a(HostArenaOptions().set_chunk_bytes(0)); }, "chunk_bytes");
  HostArena arena;
  expect_error([&] { arena.empty({4, -1}, at::kFloat); }, "negative dimension -1");
  expect_error([&] { arena.reserve(-5); }, "must be >= 0");
  expect_error([&] { arena.allocate(-1); }, "must be >= 0");
  expect_error([&] { arena.empty({int64_t{1} << 40, int64_t{1} << 40}, at::kFloat); }, "overflow");
  EXPECT_EQ(arena.stats().chunks, 0);
}

// Device::download copies into tensors of the allocator it is given.
TEST(HostArena, SimDownloadsIntoTheGivenAllocator) {
  HostArena arena;
  auto device = make_sim_devices(1).at(0);
  auto x = at::arange(300, at::kFloat).reshape({10, 30});
  auto [on_device, up] = device->upload(Queue::kActUpload, {x}, nullptr);
  device->wait(Queue::kCompute, up);
  HostAllocator allocate = [&](at::IntArrayRef sizes, at::ScalarType dtype) {
    return arena.empty(sizes, dtype);
  };
  auto [host, down] = device->download(on_device, allocate);
  down->synchronize();
  EXPECT_TRUE(host[0].equal(x));
  EXPECT_EQ(arena.stats().live_blocks, 1);
  EXPECT_EQ(arena.stats().allocated_bytes, arena.block_bytes(300 * 4));
}

// ---------------------------------------------------------------- engine

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

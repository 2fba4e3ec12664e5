// HostArena: exact sizes, reuse, coalescing, no leaks under concurrent use,
// blocks outliving the arena, idle chunks going back. The engine's use of it:
// host_arena_engine_test.cpp.
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

}  // namespace
}  // namespace roundpipe::testing

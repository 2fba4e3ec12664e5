// The device layer, on every backend: ordered copies, cross-queue and
// cross-device event waits, memory accounting, device specs.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <roundpipe/device.h>

#include <thread>

#include "device/staging_ring.h"
#include "runtime/memory/allocation_meter.h"
#include "test_util.h"

namespace roundpipe::testing {
namespace {

class DeviceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DeviceTest, UploadComputeDownloadRoundTrip) {
  auto devices = make_devices(GetParam());
  for (auto& device : devices) {
    std::vector<at::Tensor> host;
    for (int64_t n : {0, 1, 7, 1023, 40000}) host.push_back(at::randn({n}));
    auto [dev, up] = device->upload(Queue::kActUpload, host, nullptr);
    device->wait(Queue::kCompute, up);
    std::vector<at::Tensor> doubled;
    device->enqueue(Queue::kCompute, [&] {
      for (auto& t : dev) doubled.push_back(t * 2);
    });
    for (auto& t : doubled) EXPECT_EQ(t.device(), device->torch_device());
    auto [back, down] = device->download(doubled);
    down->synchronize();
    EXPECT_TRUE(down->query());
    for (size_t i = 0; i < host.size(); ++i) EXPECT_TRUE(at::equal(back[i], host[i] * 2));
  }
}

TEST_P(DeviceTest, CountsTheBytesItMoves) {
  auto device = make_devices(GetParam()).front();
  const auto before = device->transfer_stats();
  std::vector<at::Tensor> host = {at::randn({1000}), at::randn({24}, at::kDouble)};
  auto [params, up] = device->upload(Queue::kParamUpload, host, nullptr);
  auto [acts, act_up] = device->upload(Queue::kActUpload, {host[0]}, nullptr);
  device->wait(Queue::kCompute, up);
  device->wait(Queue::kCompute, act_up);
  auto [back, down] = device->download(params);
  down->synchronize();
  const auto after = device->transfer_stats();
  EXPECT_EQ(after.param_upload_bytes - before.param_upload_bytes, 1000 * 4 + 24 * 8);
  EXPECT_EQ(after.activation_upload_bytes - before.activation_upload_bytes, 1000 * 4);
  EXPECT_EQ(after.download_bytes - before.download_bytes, 1000 * 4 + 24 * 8);
}

TEST_P(DeviceTest, CrossDeviceHandOffWaitsForTheEvent) {
  auto devices = make_devices(GetParam());
  auto& a = devices.front();
  auto& b = devices.back();
  // Many hand-offs a -> host -> b: b must always see a's finished copy.
  for (int i = 0; i < 50; ++i) {
    auto src = at::full({4096}, static_cast<float>(i));
    auto [on_a, up] = a->upload(Queue::kActUpload, {src}, nullptr);
    a->wait(Queue::kCompute, up);
    at::Tensor produced;
    a->enqueue(Queue::kCompute, [&] { produced = on_a[0] + 1; });
    auto [host, down] = a->download({produced});
    auto [on_b, up_b] = b->upload(Queue::kActUpload, host, down);  // waits for a's download
    b->wait(Queue::kCompute, up_b);
    at::Tensor result;
    b->enqueue(Queue::kCompute, [&] { result = on_b[0].sum(); });
    auto [final, done] = b->download({result});
    done->synchronize();
    ASSERT_EQ(final[0].item<float>(), 4096.0f * (i + 1));
  }
}

TEST_P(DeviceTest, GeneratorDrawsOnTheDevice) {
  auto devices = make_devices(GetParam());
  auto gen = devices[0]->generator();
  EXPECT_EQ(gen.device().type(), devices[0]->torch_device().type());
}

INSTANTIATE_TEST_SUITE_P(AllBackends, DeviceTest, ::testing::ValuesIn(backends()),
                         [](const auto& info) { return backend_test_name(info.param); });

TEST(SimDevice, MemoryBudgetCountsLiveTensorsAndThrowsOutOfMemory) {
  SimDeviceOptions options;
  options.memory_budget_bytes = 4096;
  auto device = make_sim_devices(1, options)[0];
  {
    auto [t, e] = device->upload(Queue::kParamUpload, {at::zeros({512})}, nullptr);  // 2 KiB
    e->synchronize();
    EXPECT_EQ(device->memory_stats().in_use_bytes, 2048);
    try {
      device->upload(Queue::kParamUpload, {at::zeros({1024})}, nullptr);  // 4 KiB more
      FAIL() << "expected out of memory";
    } catch (const c10::OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("sim:0 out of memory"), std::string::npos);
    }
  }
  EXPECT_EQ(device->memory_stats().in_use_bytes, 0);  // freed with the tensor
  EXPECT_EQ(device->memory_stats().peak_bytes, 2048);
}

TEST(SimDevice, BandwidthThrottleSlowsCopies) {
  SimDeviceOptions options;
  options.bandwidth_gbps = 0.01;  // 10 MB/s: 100 KB takes 10 ms
  auto device = make_sim_devices(1, options)[0];
  const auto start = std::chrono::steady_clock::now();
  auto [t, e] = device->upload(Queue::kActUpload, {at::zeros({25000})}, nullptr);
  e->synchronize();
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(9));
}

// Parameter uploads go in chunks of at most the chunk size: small tensors
// grouped, large ones sliced, contents intact.
TEST(CopyChunks, GroupSmallTensorsAndSliceLargeOnes) {
  const int64_t chunk = 4096;  // bytes: 1024 floats
  std::vector<at::Tensor> src = {at::randn({100}),  at::randn({3000}), at::randn({10}),
                                 at::randn({1024}), at::randn({0}),    at::randn({7})};
  std::vector<at::Tensor> dst;
  for (const auto& t : src) dst.push_back(at::empty_like(t));
  const auto chunks = copy_chunks(dst, src, chunk);
  int64_t total = 0;
  for (const auto& c : chunks) {
    int64_t bytes = 0;
    for (const auto& [d, s] : c) {
      EXPECT_EQ(d.sizes(), s.sizes());
      bytes += s.nbytes();
      d.copy_(s);
    }
    EXPECT_LE(bytes, chunk);
    EXPECT_GT(bytes, 0);
    total += bytes;
  }
  // 100 + 3000 + 10 + 1024 + 7 floats pack into ceil(4141 / 1024) = 5 full-or-last chunks.
  EXPECT_EQ(total, (100 + 3000 + 10 + 1024 + 7) * 4);
  EXPECT_EQ(chunks.size(), 5u);
  for (size_t i = 0; i < src.size(); ++i) EXPECT_TRUE(at::equal(dst[i], src[i])) << i;
  // A non-contiguous tensor is one copy, whatever its size.
  auto strided = at::randn({64, 64}).t();
  auto strided_dst = at::empty_like(strided);
  const auto whole = copy_chunks({strided_dst}, {strided}, chunk);
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_EQ(whole[0].size(), 1u);
}

TEST(SimDevice, ParameterUploadsGoInChunks) {
  auto device = make_devices("sim:1,chunk=64KiB,jitter_us=50").front();
  // Parameters require grad: the slicing must not be an autograd op.
  std::vector<at::Tensor> host = {at::randn({5000}).requires_grad_(), at::randn({100000}),
                                  at::randn({300})};
  auto [dev, up] = device->upload(Queue::kParamUpload, host, nullptr);
  up->synchronize();
  for (size_t i = 0; i < host.size(); ++i) EXPECT_TRUE(at::equal(dev[i], host[i])) << i;
  const auto stats = device->transfer_stats();
  EXPECT_EQ(stats.param_upload_bytes, (5000 + 100000 + 300) * 4);
  EXPECT_LE(stats.largest_param_copy_bytes, 64 * 1024);
  // 421,200 bytes in chunks of 65,536: 7 copies.
  EXPECT_EQ(stats.param_upload_copies, 7);
}

// Pageable parameter uploads through a ring of two small slots (Note
// [Staging ring]): more chunks than slots, so each slot is refilled only
// after the copy that read it; a strided source is staged through copy_;
// odd-length bf16 tensors before float ones (a full slot needs padding).
TEST_P(DeviceTest, PageableParameterUploadsGoThroughTheStagingRing) {
  auto device = make_devices(GetParam()).front();
  StagingRing ring(2, 64 * 1024, device->supports_pinned_memory(), 2);
  std::vector<at::Tensor> host = {at::randn({5001}).to(at::kBFloat16),
                                  at::randn({3}),
                                  at::randn({5001}).to(at::kBFloat16),
                                  at::randn({100000}).requires_grad_(),
                                  at::randn({40, 30}).t(),
                                  at::randn({300})};
  int64_t bytes = 0;
  for (const auto& t : host) bytes += static_cast<int64_t>(t.nbytes());
  for (int round = 0; round < 3; ++round) {  // the slots' memory is reused every round
    auto [dev, up] = device->upload(Queue::kParamUpload, host, nullptr, &ring);
    up->synchronize();
    for (size_t i = 0; i < host.size(); ++i)
      EXPECT_TRUE(at::equal(dev[i].cpu(), host[i])) << "tensor " << i << " round " << round;
    for (auto& t : host) t = t + 1;  // the next round's values differ
  }
  EXPECT_EQ(ring.staged_bytes(), 3 * bytes);
  EXPECT_LE(device->transfer_stats().largest_param_copy_bytes, 64 * 1024);
  if (device->supports_pinned_memory()) {  // pinned sources are copied from where they are
    auto pinned = at::randn({1000}).pin_memory();
    auto [dev, up] = device->upload(Queue::kParamUpload, {pinned}, nullptr, &ring);
    up->synchronize();
    EXPECT_TRUE(at::equal(dev[0].cpu(), pinned));
    EXPECT_EQ(ring.staged_bytes(), 3 * bytes);
  }
}

TEST(DeviceSpec, ParsesSimSpecs) {
  auto devices = make_devices("sim:3,mem=1MiB,jitter_us=10");
  ASSERT_EQ(devices.size(), 3u);
  EXPECT_EQ(devices[2]->name(), "sim:2");
  EXPECT_EQ(devices[0]->memory_stats().budget_bytes, 1 << 20);
  EXPECT_EQ(make_devices("sim").size(), 1u);
}

TEST(DeviceSpec, RejectsBadSpecsWithHelp) {
  for (const char* bad : {"tpu", "sim:x", "sim:2,mem=5XB", "sim:2,colour=red", "cuda:a",
                          "sim:1,chunk=0", "sim:2,jitter_us=-5", "sim:2,jitter_us=3.5", "sim:0",
                          "sim:-2", "sim:2x", "cuda:-1", "sim:1,gbps=-1", "sim:1,mem=-1MiB",
                          "cuda,mem=5XB", "cuda:0,mem=-1GiB", "cuda:0,mem=", "cudax"}) {
    try {
      make_devices(bad);
      FAIL() << bad << " was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("sim:N"), std::string::npos) << e.what();
    }
  }
}

TEST(DeviceSpec, AutoPicksGpusElseOneSim) {
  auto devices = make_devices("auto");
  if (cuda_device_count() > 0) {
    EXPECT_EQ(static_cast<int>(devices.size()), cuda_device_count());
  } else {
    ASSERT_EQ(devices.size(), 1u);
    EXPECT_TRUE(devices[0]->is_simulated());
  }
}

TEST(DevicePool, HandsOutRoundRobin) {
  DevicePool pool(make_sim_devices(3));
  std::vector<int> order;
  for (int i = 0; i < 7; ++i) order.push_back(pool.take());
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 0, 1, 2, 0}));
  // A call reserves its jobs' turns at once: the next call starts after them.
  EXPECT_EQ(pool.take(5), 1);
  EXPECT_EQ(pool.take(), 0);
  EXPECT_EQ(pool.take(0), 1);
  EXPECT_EQ(pool.take(), 1);
}

}  // namespace
}  // namespace roundpipe::testing

namespace roundpipe {
namespace {

// Note [Simulated device memory]: once a budgeted device has installed the
// charging CPU allocator, LibTorch's raw allocations (CPU kernels' scratch
// memory, e.g. GELU's) still work, on any thread, and a compute thread's
// raw allocation is charged and credited back.
TEST(SimDeviceMemory, RawAllocationsWorkThroughTheChargingAllocator) {
  auto devices = make_devices("sim:1,mem=64MiB");
  auto* allocator = c10::GetCPUAllocator();
  void* p = allocator->raw_allocate(4096);
  allocator->raw_deallocate(p);
  // (GELU ran through the charging allocator; the formula is only a check
  // that it computed. float32 erf approximations differ by a few ulps, and
  // 1 + erf cancels for negative x: 1e-5 absolute, not 1e-6, which a
  // draw of 65,536 values once missed.)
  const auto x = at::randn({1 << 16}, at::detail::createCPUGenerator(3));
  EXPECT_TRUE(at::allclose(at::gelu(x), 0.5 * x * (1 + at::erf(x / std::sqrt(2.0))), 1e-5, 1e-5));
  auto& device = *devices.front();
  const auto before = device.memory_stats().in_use_bytes;
  std::thread compute([&] {  // a thread working for the device, as its worker does
    device.bind_compute_thread();
    void* q = c10::GetCPUAllocator()->raw_allocate(1 << 20);
    EXPECT_GE(device.memory_stats().in_use_bytes, before + (1 << 20));
    c10::GetCPUAllocator()->raw_deallocate(q);
    auto y = at::gelu(at::randn({1 << 16}));
    EXPECT_EQ(y.numel(), 1 << 16);
  });
  compute.join();
  EXPECT_EQ(device.memory_stats().in_use_bytes, before);
}

// The engine's AllocationMeter reads device memory, on a simulated device as
// the CUDA caching allocator reports it on a GPU: a compute thread's
// allocations and frees, and not the host memory it allocates (a
// HostAllocationScope). The meter does not ask LibTorch's CPU allocator to
// profile: that one tracked host blocks for it and warned ("Memory block of
// unknown size was allocated before the profiling started") at the first
// free of a block older than the meter.
TEST(SimDeviceMemory, TheAllocationMeterSeesTheDevicesMemoryNotTheHosts) {
  auto devices = make_devices("sim:1");  // no budget: still charged, still reported
  auto& device = *devices.front();
  std::thread compute([&] {
    device.bind_compute_thread();
    auto older = at::empty({1 << 12}, at::kFloat);  // 16 KiB, made before the meter
    detail::MeterScope scope;
    ASSERT_NE(scope.meter(), nullptr);
    EXPECT_FALSE(c10::memoryProfilingEnabled());
    auto kept = at::empty({1 << 16}, at::kFloat);         // 256 KiB
    { auto passing = at::empty({1 << 18}, at::kFloat); }  // 1 MiB, freed at once
    {
      HostAllocationScope host;
      auto for_the_host = at::empty({1 << 20}, at::kFloat);
    }
    older.reset();
    EXPECT_EQ(scope.meter()->net_bytes(), (1 << 18) - (1 << 14));
    EXPECT_EQ(scope.meter()->peak_bytes(), (1 << 18) + (1 << 20));
  });
  compute.join();
  EXPECT_GT(device.memory_stats().peak_bytes, 0);
}

}  // namespace
}  // namespace roundpipe

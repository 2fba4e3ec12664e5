// roundpipe-bench's CUDA diagnostics: where device time goes (--profile)
// and what was allocated at each out-of-memory error (--oom-census).
// Included by train_bench.cpp only, in builds with CUDA.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <roundpipe/device.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace roundpipe_bench {

// Kernel time by name over `steps` iterations (CUPTI sees the kernels of
// every worker thread), so that a reader sees where device time goes: the
// busy fraction per stream says whether a GPU waits (bubbles, uploads) or
// computes, and the kernel table which computation dominates.
// Where each GPU's compute stream (its busiest) sits idle: the largest gaps
// between its kernels, when they happen, what ran before and after, and how
// busy the GPU's other streams (uploads, downloads) were meanwhile.
void print_compute_gaps(const torch::autograd::profiler::ProfilerResult& result, int gpus) {
  struct Span {
    int64_t start, end;
    int64_t stream;
    std::string name;
  };
  std::map<int, std::vector<Span>> by_gpu;
  int64_t origin = std::numeric_limits<int64_t>::max();
  for (const auto& e : result.events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    const int64_t start = static_cast<int64_t>(e.startNs());
    by_gpu[e.deviceIndex()].push_back(
        {start, start + static_cast<int64_t>(e.durationNs()), e.deviceResourceId(), e.name()});
    origin = std::min(origin, start);
  }
  for (auto& [gpu, spans] : by_gpu) {
    if (gpu >= gpus) continue;
    std::map<int64_t, int64_t> busy, kernel_time;
    for (const auto& sp : spans) {
      busy[sp.stream] += sp.end - sp.start;
      if (sp.name.rfind("Memcpy", 0) != 0 && sp.name.rfind("Memset", 0) != 0)
        kernel_time[sp.stream] += sp.end - sp.start;
    }
    if (kernel_time.empty()) continue;
    const int64_t compute =
        std::max_element(kernel_time.begin(), kernel_time.end(), [](auto& a, auto& b) {
          return a.second < b.second;
        })->first;
    std::vector<Span> kernels;
    for (const auto& sp : spans)
      if (sp.stream == compute) kernels.push_back(sp);
    std::sort(kernels.begin(), kernels.end(),
              [](const Span& a, const Span& b) { return a.start < b.start; });
    struct Gap {
      int64_t start, length;
      size_t after;
    };
    std::vector<Gap> gaps;
    int64_t idle = 0, reach = kernels.empty() ? 0 : kernels[0].end;
    for (size_t i = 1; i < kernels.size(); ++i) {
      const int64_t gap = kernels[i].start - reach;
      if (gap > 1'000'000) {  // > 1 ms
        gaps.push_back({reach, gap, i});
        idle += gap;
      }
      reach = std::max(reach, kernels[i].end);
    }
    std::sort(gaps.begin(), gaps.end(), [](auto& a, auto& b) { return a.length > b.length; });
    std::printf("  gpu %d compute stream %lld: %zu gaps over 1 ms, %.1f ms idle in all\n", gpu,
                static_cast<long long>(compute), gaps.size(), idle / 1e6);
    auto short_name = [](const std::string& n) { return n.substr(0, 48); };
    for (size_t g = 0; g < gaps.size() && g < 12; ++g) {
      const auto& gap = gaps[g];
      std::string others;
      for (const auto& [stream, total] : busy) {
        if (stream == compute) continue;
        int64_t overlap = 0;
        for (const auto& sp : spans) {
          if (sp.stream != stream) continue;
          overlap += std::max<int64_t>(
              0, std::min(sp.end, gap.start + gap.length) - std::max(sp.start, gap.start));
        }
        if (overlap > 0)
          others += " s" + std::to_string(stream) + ":" +
                    std::to_string(static_cast<int>(overlap / 1e6)) + "ms";
      }
      // The absolute stamp is ROUNDPIPE_TRACE's (wall-clock ms modulo 100 s).
      std::printf("    %6.1f ms at +%7.1f ms (@%9.3f)  after %s  before %s |%s\n", gap.length / 1e6,
                  (gap.start - origin) / 1e6, std::fmod(gap.start / 1e6, 1e5),
                  short_name(kernels[gap.after - 1].name).c_str(),
                  short_name(kernels[gap.after].name).c_str(), others.c_str());
    }
  }
}

// --oom-census: at each out-of-memory error of the caching allocator (the
// engine retries the microbatch), what was allocated, by block size: which
// tensors a plan's memory model missed (parameters, hand-offs, activations).
void attach_oom_census() {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  alloc::attachOutOfMemoryObserver([](int64_t device, size_t asked, size_t, size_t) {
    std::map<size_t, std::pair<int, size_t>> by_size;  // MiB -> (blocks, bytes)
    size_t total = 0;
    for (const auto& segment : alloc::snapshot({0, 0}, /*include_traces=*/false).segments) {
      if (segment.device != device) continue;
      for (const auto& block : segment.blocks) {
        if (!block.allocated) continue;
        auto& entry = by_size[block.size >> 20];
        ++entry.first;
        entry.second += block.size;
        total += block.size;
      }
    }
    std::vector<std::pair<size_t, std::pair<int, size_t>>> rows(by_size.begin(), by_size.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
    std::fprintf(stderr,
                 "oom census: asked %.2f GiB with %.2f GiB allocated:", asked / 1073741824.0,
                 total / 1073741824.0);
    for (size_t i = 0; i < rows.size() && i < 16; ++i)
      std::fprintf(stderr, " %zu x %zu MiB (%.2f GiB);", static_cast<size_t>(rows[i].second.first),
                   rows[i].first, rows[i].second.second / 1073741824.0);
    std::fprintf(stderr, "\n");
  });
}

template <typename Step>
void profile_kernels(int steps, const roundpipe::DevicePool& pool, Step step,
                     double wall_per_step) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const std::set<ActivityType> activities{ActivityType::CUDA};
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  for (int i = 0; i < steps; ++i) step();
  for (int d = 0; d < pool.size(); ++d)
    torch::cuda::synchronize(pool.at(d)->torch_device().index());
  auto result = prof::disableProfiler();
  struct Row {
    double us = 0;
    int64_t calls = 0;
  };
  std::map<std::string, Row> by_name;
  std::map<std::pair<int, int64_t>, double> by_stream;  // (GPU, stream)
  double total = 0;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    const double us = e.durationNs() / 1000.0;
    auto name = e.name();
    if (name.size() > 90) name = name.substr(0, 90);
    by_name[name].us += us;
    by_name[name].calls += 1;
    by_stream[{e.deviceIndex(), e.deviceResourceId()}] += us;
    total += us;
  }
  print_compute_gaps(*result, pool.size());
  std::vector<std::pair<std::string, Row>> rows(by_name.begin(), by_name.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.us > b.second.us; });
  std::printf("profile: %d step(s), device activity %.1f ms per step (wall %.1f ms per step)\n",
              steps, total / 1000.0 / steps, wall_per_step * 1000.0);
  for (const auto& [where, us] : by_stream)
    std::printf("  gpu %d stream %lld busy %.1f ms per step (%.0f%% of wall)\n", where.first,
                static_cast<long long>(where.second), us / 1000.0 / steps,
                100.0 * us / 1e6 / steps / wall_per_step);
  std::printf("  %8s %6s %7s  %s\n", "ms/step", "share", "calls", "kernel or copy");
  for (size_t i = 0; i < rows.size() && i < 40; ++i)
    std::printf("  %8.2f %5.1f%% %7lld  %s\n", rows[i].second.us / 1000.0 / steps,
                100.0 * rows[i].second.us / total,
                static_cast<long long>(rows[i].second.calls / steps), rows[i].first.c_str());
}

}  // namespace roundpipe_bench

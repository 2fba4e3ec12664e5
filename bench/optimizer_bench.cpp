// The CPU optimizer against its ceilings, in one run (Google Benchmark):
//   triad            a = b + s * c over large arrays: the memory-bandwidth bound
//   roundpipe_adam   our Adam on fp32 parameters and gradients (general path)
//   roundpipe_fused  our fused pass: bf16 gradient -> fp32 master -> bf16 weight
//   roundpipe_fused_8bit  the same with 8-bit moments (optim_bits = 8)
//   torch_adamw      torch::optim::AdamW on the same fp32 tensors
//   grad_norm        the global norm of bf16 gradients (clipping's extra pass)
// Effective bytes per parameter for an Adam step are 28 (read parameter,
// gradient and two moments, write parameter and moments; for the fused pass
// 12 + 2 read, 12 + 2 written; with 8-bit moments 6 + 2 read and written,
// 16 in all). Prints a ratio table at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/optim/grad_clip.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <map>

#include "support/parallel.h"

namespace {

int64_t total_params() {
  const char* env = std::getenv("ROUNDPIPE_BENCH_PARAMS");
  return env ? std::atoll(env) : int64_t{48} << 20;  // 48M parameters
}

// Parameters shaped like a transformer's: a few large matrices, small vectors.
std::vector<at::Tensor> make_tensors(at::ScalarType dtype, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  const int64_t total = total_params();
  std::vector<at::Tensor> out;
  int64_t left = total;
  const int64_t big = total / 12;
  while (left > 0) {
    const int64_t n = std::min(left, out.size() % 4 == 3 ? int64_t{4099} : big);
    out.push_back(at::randn({n}, gen).to(dtype));
    left -= n;
  }
  return out;
}

void set_rates(benchmark::State& state, int64_t elements, double bytes_per_element) {
  state.SetItemsProcessed(state.iterations() * elements);
  state.counters["GB/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * elements * bytes_per_element / 1e9,
      benchmark::Counter::kIsRate);
}

__attribute__((noinline)) void triad_range(float* __restrict a, const float* __restrict b,
                                           const float* __restrict c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
}
__attribute__((noinline)) void update_range(float* __restrict a, const float* __restrict b,
                                            int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = a[i] * 0.999f + b[i];
}

// The same threads and chunking as the optimizer.
constexpr int64_t kChunk = 1 << 15;
int64_t chunks(int64_t n) {
  return (n + kChunk - 1) / kChunk;
}

// Streaming arrays of 1 GiB at least, far beyond any L3 (the 16-core GPU
// host has 300 MB), so the bound is main memory's.
int64_t stream_elements() {
  return std::max<int64_t>(total_params(), int64_t{256} << 20);
}

// STREAM triad: a = b + s * c (two reads and a write per element).
void triad(benchmark::State& state) {
  const int64_t n = stream_elements();
  auto a = at::empty({n}), b = at::randn({n}), c = at::randn({n});
  for (auto _ : state) {
    roundpipe::parallel_for_each(chunks(n), [&](int64_t i) {
      const int64_t lo = i * kChunk, len = std::min(kChunk, n - lo);
      triad_range(a.data_ptr<float>() + lo, b.data_ptr<float>() + lo, c.data_ptr<float>() + lo,
                  len);
    });
    benchmark::ClobberMemory();
  }
  set_rates(state, n, 12);
}

// In-place update a = a * s + b: Adam's access pattern (updated arrays are
// read first, so writes cost no extra read), two reads and a write.
void update(benchmark::State& state) {
  const int64_t n = stream_elements();
  auto a = at::randn({n}), b = at::randn({n});
  for (auto _ : state) {
    roundpipe::parallel_for_each(chunks(n), [&](int64_t i) {
      const int64_t lo = i * kChunk, len = std::min(kChunk, n - lo);
      update_range(a.data_ptr<float>() + lo, b.data_ptr<float>() + lo, len);
    });
    benchmark::ClobberMemory();
  }
  set_rates(state, n, 12);
}

void roundpipe_adam(benchmark::State& state) {
  auto params = make_tensors(at::kFloat, 1);
  for (auto& p : params) p.mutable_grad() = at::randn_like(p) * 1e-3;
  roundpipe::optim::Adam adam(
      params,
      roundpipe::optim::AdamConfig().set_lr(1e-4).set_weight_decay(0.01).set_decoupled_weight_decay(
          true));
  for (auto _ : state) adam.step();
  set_rates(state, total_params(), 28);
}

// The fused pass over bf16 gradients and weights with `config`'s state.
void fused_pass(benchmark::State& state, roundpipe::optim::AdamConfig config,
                double bytes_per_param) {
  auto masters = make_tensors(at::kFloat, 1);
  std::vector<at::Tensor> grads, weights;
  for (const auto& m : masters) {
    grads.push_back((at::randn_like(m) * 1e-3).to(at::kBFloat16));
    weights.push_back(at::empty_like(m, at::TensorOptions().dtype(at::kBFloat16)));
  }
  roundpipe::optim::Adam adam(
      masters, config.set_lr(1e-4).set_weight_decay(0.01).set_decoupled_weight_decay(true));
  for (auto _ : state) adam.fused_step(masters, grads, weights);
  set_rates(state, total_params(), bytes_per_param);
}

void roundpipe_fused(benchmark::State& state) {
  fused_pass(state, roundpipe::optim::AdamConfig(), 28);
}

void roundpipe_fused_8bit(benchmark::State& state) {
  fused_pass(state, roundpipe::optim::AdamConfig().set_optim_bits(8), 16);
}

void torch_adamw(benchmark::State& state) {
  auto params = make_tensors(at::kFloat, 1);
  for (auto& p : params) p.mutable_grad() = at::randn_like(p) * 1e-3;
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  for (auto _ : state) adamw.step();
  set_rates(state, total_params(), 28);
}

// The pass a clipped step adds before its update: 2 bytes read per parameter.
void grad_norm(benchmark::State& state) {
  std::vector<at::Tensor> grads;
  for (const auto& m : make_tensors(at::kFloat, 1)) grads.push_back(m.to(at::kBFloat16));
  for (auto _ : state) benchmark::DoNotOptimize(roundpipe::optim::global_grad_norm(grads));
  set_rates(state, total_params(), 2);
}

BENCHMARK(triad)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();
BENCHMARK(update)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();
BENCHMARK(roundpipe_adam)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();
BENCHMARK(roundpipe_fused)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();
BENCHMARK(roundpipe_fused_8bit)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();
BENCHMARK(torch_adamw)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();
BENCHMARK(grad_norm)->Unit(benchmark::kMillisecond)->MinTime(2)->UseRealTime();

// Keeps each benchmark's rates for the summary.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& run : runs) {
      auto items = run.counters.find("items_per_second");
      auto gbs = run.counters.find("GB/s");
      if (items != run.counters.end()) params_per_s[run.benchmark_name()] = items->second.value;
      if (gbs != run.counters.end()) gb_per_s[run.benchmark_name()] = gbs->second.value;
    }
  }
  std::map<std::string, double> params_per_s, gb_per_s;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  std::printf("parameters: %lld, roundpipe threads: %d, ATen threads: %d\n",
              static_cast<long long>(total_params()), roundpipe::parallel_threads(),
              at::get_num_threads());
  SummaryReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  auto& p = reporter.params_per_s;
  auto& g = reporter.gb_per_s;
  // The bandwidth bound: the faster of the two streaming kernels.
  const double bound =
      std::max(g["triad/min_time:2.000/real_time"], g["update/min_time:2.000/real_time"]);
  std::printf("\n%-22s %14s %10s %14s %18s\n", "optimizer", "Mparams/s", "GB/s", "x torch AdamW",
              "% of bandwidth");
  for (const char* name :
       {"roundpipe_adam", "roundpipe_fused", "roundpipe_fused_8bit", "torch_adamw"}) {
    const std::string key = std::string(name) + "/min_time:2.000/real_time";
    std::printf("%-22s %14.1f %10.2f %14.2f %15.1f%%\n", name, p[key] / 1e6, g[key],
                p[key] / p["torch_adamw/min_time:2.000/real_time"], 100 * g[key] / bound);
  }
  std::printf("%-22s %14s %10.2f\n", "triad", "", g["triad/min_time:2.000/real_time"]);
  std::printf("%-22s %14s %10.2f\n", "update (in place)", "", g["update/min_time:2.000/real_time"]);
  std::printf("bandwidth bound: %.2f GB/s\n", bound);
  // Clipping's norm pass against the fused step it precedes, per parameter.
  const double norm_rate = p["grad_norm/min_time:2.000/real_time"];
  std::printf("grad_norm: %.1f Mparams/s (%.2f GB/s), %.1f%% of a fused step's time\n",
              norm_rate / 1e6, g["grad_norm/min_time:2.000/real_time"],
              100 * p["roundpipe_fused/min_time:2.000/real_time"] / norm_rate);
  std::printf("8-bit moments: a fused step takes %.2fx the time of one with float32 moments\n",
              p["roundpipe_fused/min_time:2.000/real_time"] /
                  p["roundpipe_fused_8bit/min_time:2.000/real_time"]);
  return 0;
}

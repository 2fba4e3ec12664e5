// roundpipe-bench: trains the native Qwen3 preset (random weights) through
// RoundPipe and prints, in one run: tokens/s; linear-layer TFLOP/s and that
// as a fraction of a matmul rate measured in the same run; host-to-device
// bytes per iteration and the achieved rate against a pinned-copy rate
// measured in the same run; peak device memory. --max-seq searches the
// longest sequence (batch 1) that trains under --memory-cap.
//
//   roundpipe-bench --shape 1.7B --batch 16 --seq 4096 --devices cuda
//   roundpipe-bench --shape tiny --devices sim:2           (anywhere)
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "process_memory.h"

#ifdef ROUNDPIPE_WITH_CUDA
#include "cuda_diagnostics.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;
using roundpipe::DevicePtr;
using roundpipe_bench::resident_by_kind;
using roundpipe_bench::status_gib;

std::string shape_json(const std::string& shape) {
  // Qwen3 shapes as published (vocab 151936; tied embeddings up to 4B).
  std::string dims;
  if (shape == "32B") {
    dims = R"("hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
              "num_attention_heads": 64, "num_key_value_heads": 8)";
  } else if (shape == "8B") {
    dims = R"("hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
              "num_attention_heads": 32, "num_key_value_heads": 8)";
  } else if (shape == "1.7B") {
    dims = R"("hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8)";
  } else if (shape == "4B") {
    dims = R"("hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
              "num_attention_heads": 32, "num_key_value_heads": 8)";
  } else if (shape == "32B-mini") {
    // 32B's proportions at 1/16 of its width (q 1.6 x, kv 0.2 x, MLP 5 x the
    // hidden size), for what a plan does on a simulated budget: at 1024
    // tokens a microbatch its activations weigh against its weights as 32B's
    // do at 16 x 4096 tokens in 4 microbatches.
    dims = R"("hidden_size": 320, "intermediate_size": 1600, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 2)";
  } else if (shape == "tiny") {
    dims = R"("hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2)";
  } else {
    throw std::invalid_argument("unknown --shape " + shape +
                                " (tiny, 32B-mini, 1.7B, 4B, 8B, 32B)");
  }
  const bool small = shape == "tiny" || shape == "32B-mini";
  const std::string vocab = small ? "1024" : "151936";
  return R"({"model_type": "qwen3", "vocab_size": )" + vocab + ", " + dims + R"(, "head_dim": )" +
         (small ? "32" : "128") +
         R"(, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
             "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": )" +
         (shape == "8B" || shape == "32B" ? "false}" : "true}");
}

void synchronize(const DevicePtr& device) {
#ifdef ROUNDPIPE_WITH_CUDA
  if (device->torch_device().is_cuda()) torch::cuda::synchronize(device->torch_device().index());
#endif
}

// Seconds per call of fn on `device`, after one warm-up call.
template <typename F>
double time_on(const DevicePtr& device, int repeats, F fn) {
  fn();
  synchronize(device);
  const auto start = Clock::now();
  for (int i = 0; i < repeats; ++i) fn();
  synchronize(device);
  return std::chrono::duration<double>(Clock::now() - start).count() / repeats;
}

double matmul_tflops(const DevicePtr& device, c10::ScalarType dtype) {
  const int64_t n = device->torch_device().is_cuda() ? 8192 : 1024;
  auto opts = torch::TensorOptions().dtype(dtype).device(device->torch_device());
  auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
  const double s = time_on(device, 10, [&] { (void)at::matmul(a, b); });
  return 2.0 * n * n * n / s / 1e12;
}

double pinned_copy_gbps(const DevicePtr& device) {
  const int64_t bytes = device->torch_device().is_cuda() ? (int64_t{1} << 30) : (int64_t{64} << 20);
  auto host = torch::empty({bytes}, torch::kUInt8);
  if (device->supports_pinned_memory()) host = host.pin_memory();
  auto dst = torch::empty(
      {bytes}, torch::TensorOptions().dtype(torch::kUInt8).device(device->torch_device()));
  const double s = time_on(device, 5, [&] { dst.copy_(host, /*non_blocking=*/true); });
  return bytes / s / 1e9;
}

struct Setup {
  std::string shape = "tiny", devices = "", dtype = "bfloat16", recompute = "stage";
  int64_t batch = 4, seq = 256;
  int microbatches = 0, warmup = 3, steps = 5;
  double memory_cap_gib = 0;
  int64_t seq_start = 1024, seq_limit = int64_t{1} << 20;  // --max-seq search range
  bool max_seq = false, verbose = false;
  bool freeze_linear = false;  // train only the norms: uploads, not compute, bound a small batch
  int profile_steps = 0;
  bool oom_census = false;    // CUDA: print the allocated blocks at each out-of-memory error
  int64_t lora_rank = 0;      // > 0: LoRA adapters on every projection, the base frozen
  std::string quantize_base;  // nf4, fp4, int8 or fp8: the base quantized (QLoRA)
};

// The first layer's down_proj dequantized on `device` equals the CPU
// path's result bit for bit (tests/models/quantized_test.cpp and
// quantized_8bit_test.cpp check it where the tests run on a GPU; this, on
// the machine the numbers come from), and how fast.
void check_dequantization(const roundpipe::models::CausalLM& model, const DevicePtr& device) {
  namespace m = roundpipe::models;
  if (!device->torch_device().is_cuda()) return;
  std::map<std::string, at::Tensor> named;
  for (const auto& [name, p] : model.hf_state_dict()) named[name] = p;
  const std::string w = "model.layers.0.mlp.down_proj.weight";
  const auto type = *model.options().quantize_base;
  const std::vector<int64_t> shape = {model.config().hidden_size, model.config().intermediate_size};
  // The weight dequantized where `on` puts its tensors; its bytes.
  int64_t bytes = 0;
  auto dequantize = [&](const std::function<at::Tensor(const at::Tensor&)>& on) {
    if (!m::is_4bit(type)) {
      const m::Quantized8Bit q{type, at::kBFloat16, on(named.at(w)), on(named.at(w + "_scale"))};
      bytes = q.values.nbytes() + q.scale.nbytes();
      return m::dequantize_8bit(q);
    }
    m::Quantized4Bit q;
    q.type = type;
    q.shape = shape;
    q.packed = on(named.at(w));
    q.absmax = on(named.at(w + "_absmax"));
    if (model.options().double_quant) {
      q.nested_absmax = on(named.at(w + "_nested_absmax"));
      q.nested_code = on(named.at(w + "_nested_code"));
      q.nested_offset = on(named.at(w + "_nested_offset"));
    }
    bytes = q.nbytes();
    return m::dequantize_4bit(q);
  };
  const auto cpu = dequantize([](const at::Tensor& t) { return t; });
  std::map<const void*, at::Tensor> uploaded;  // (each once, outside the timing)
  auto upload = [&](const at::Tensor& t) {
    auto& u = uploaded[t.data_ptr()];
    if (!u.defined()) u = t.to(device->torch_device());
    return u;
  };
  const bool same = at::equal(cpu, dequantize(upload).cpu());
  const double seconds = time_on(device, 20, [&] { dequantize(upload); });
  std::printf(
      "%s dequantization (%lld x %lld to bf16) on %s equals the CPU path: %s; %.0f us, "
      "%.0f GB/s moved\n",
      m::to_string(type), static_cast<long long>(shape[0]), static_cast<long long>(shape[1]),
      device->name().c_str(), same ? "yes" : "NO", seconds * 1e6,
      (bytes + 2.0 * cpu.numel()) / seconds / 1e9);
  // The kernels' one-value-a-thread forms (Note [A wide thread a scale],
  // Note [8-bit weights, 16 a thread]): the bytes one past an aligned address.
  const at::Tensor& codes = named.at(w);
  const auto shifted =
      at::empty({codes.numel() + 1}, codes.options().device(device->torch_device()));
  shifted.narrow(0, 1, codes.numel()).copy_(upload(codes).reshape(-1));
  uploaded[codes.data_ptr()] = shifted.narrow(0, 1, codes.numel()).view(codes.sizes());
  const bool narrow_same = at::equal(cpu, dequantize(upload).cpu());
  const double narrow = time_on(device, 20, [&] { dequantize(upload); });
  std::printf("  its one-byte-a-thread form (unaligned bytes) equals it too: %s; %.0f us\n",
              narrow_same ? "yes" : "NO", narrow * 1e6);
}

std::unique_ptr<roundpipe::RoundPipe> wrap(roundpipe::models::CausalLM& model, const Setup& s) {
  auto options =
      roundpipe::RoundPipeOptions().set_optim_dtype(torch::kFloat).set_devices(s.devices);
  roundpipe::RunConfig run;
  if (s.microbatches > 0) run.set_num_microbatch(s.microbatches);
  // Its loss_fn returns the preset's loss, which adds up over rows (as
  // roundpipe-train's and the Python package's default loss_fn do): the
  // tail may run in chunks of rows (Note [Tail row chunks]).
  run.set_loss_sums_over_rows(true);
  run.set_recompute_grain(roundpipe::recompute_grain_from_string(s.recompute));
  options.set_model_run_config(run);
  if (s.memory_cap_gib > 0) options.set_model_memory_limit_gib(s.memory_cap_gib);
  options.set_verbose(s.verbose);
  return std::make_unique<roundpipe::RoundPipe>(model.sequential(), options);
}

roundpipe::LossFn loss_of_output() {
  return [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); };
}

int train(const Setup& s) {
  auto config = roundpipe::models::CausalLMConfig::from_json_string(shape_json(s.shape), s.shape);
  const auto dtype = roundpipe::dtype_from_string(s.dtype);
  auto model_options = roundpipe::models::CausalLMOptions().set_dtype(dtype);
  if (s.lora_rank > 0) {  // peft's defaults for QLoRA recipes: alpha 2 r, fp32 factors
    model_options.set_lora(roundpipe::models::LoraOptions()
                               .set_rank(s.lora_rank)
                               .set_alpha(2.0 * s.lora_rank)
                               .set_targets({"all-linear"}));
    model_options.lora.dtype = torch::kFloat;
  }
  if (!s.quantize_base.empty())
    model_options.set_quantize_base(roundpipe::models::quant_type_from_string(s.quantize_base));
  const auto made = Clock::now();
  roundpipe::models::CausalLM model(config, model_options);
  std::printf("model made in %.1f s\n", std::chrono::duration<double>(Clock::now() - made).count());
  // Where the host's resident memory goes: the model as made, then wrapped
  // (its tensors moved into the arena), then trained (printed at the end).
  const double rss_made = status_gib("VmRSS"), hwm_made = status_gib("VmHWM");
  if (s.freeze_linear) {
    for (auto& p : model.sequential()->parameters()) {
      if (p.dim() == 2) p.requires_grad_(false);
    }
  }
  auto pipe = wrap(model, s);
  const double rss_wrapped = status_gib("VmRSS");
  std::printf("host resident memory wrapped: %s\n", resident_by_kind().c_str());
#ifdef ROUNDPIPE_WITH_CUDA
  if (s.oom_census && torch::cuda::is_available()) roundpipe_bench::attach_oom_census();
#endif
  const auto& pool = pipe->devices();
  const auto device = pool.at(0);
  if (!s.quantize_base.empty()) check_dequantization(model, device);
  std::printf(
      "roundpipe-bench: qwen3 %s, %d layers, dtype %s, %d device(s) %s, batch %lld x %lld tokens\n",
      s.shape.c_str(), pipe->num_layers(), s.dtype.c_str(), pool.size(), device->name().c_str(),
      static_cast<long long>(s.batch), static_cast<long long>(s.seq));
  const double matmul = matmul_tflops(device, dtype);
  const double copy = pinned_copy_gbps(device);
  std::printf("ceilings on %s: matmul %.1f TFLOP/s (%s), host-to-device copy %.1f GB/s (%s)\n",
              device->name().c_str(), matmul, s.dtype.c_str(), copy,
              device->supports_pinned_memory() ? "pinned" : "pageable");

  // Linear-layer parameters (2-D weights; the tied embedding counts once, as lm_head).
  int64_t linear = 0, all = 0, trainable = 0;
  for (const auto& [name, p] : pipe->named_parameters()) {
    // (A 4-bit weight is its packed codes, two values a byte.)
    const bool packed = p.scalar_type() == torch::kByte && name.size() > 7 &&
                        name.compare(name.size() - 7, 7, ".weight") == 0;
    all += packed ? 2 * p.numel() : p.numel();
    if (p.requires_grad()) trainable += p.numel();
    if (p.dim() == 2 || packed) linear += packed ? 2 * p.numel() : p.numel();
  }
  roundpipe::optim::Adam adam(pipe->optim_parameters(),
                              roundpipe::optim::AdamConfig().set_lr(1e-5));
  auto ids = torch::randint(0, config.vocab_size, {s.batch, s.seq}, torch::kLong);
  auto input = c10::ivalue::Tuple::create({ids, c10::IValue(), ids});
  auto run_step = [&] {
    auto loss = pipe->forward_backward(input, c10::IValue(), loss_of_output()).loss;
    pipe->step(adam, /*is_async=*/true);
    return loss;
  };
  for (int i = 0; i < s.warmup; ++i) run_step();
  pipe->synchronize();
  // The warm-up's peak (the first calls' plans), then the timed steps' own.
  int64_t warmup_peak = 0;
  roundpipe::DeviceTransferStats before[8];
  for (int d = 0; d < pool.size() && d < 8; ++d) {
    before[d] = pool.at(d)->transfer_stats();
    warmup_peak = std::max(warmup_peak, pool.at(d)->memory_stats().peak_bytes);
    pool.at(d)->reset_peak_memory();
  }
  const auto waits_before = pipe->pipeline_stats();
  const auto start = Clock::now();
  at::Tensor loss;
  std::vector<Clock::time_point> returned;  // when each call's losses came back
  for (int i = 0; i < s.steps; ++i) {
    loss = run_step();
    returned.push_back(Clock::now());
  }
  pipe->synchronize();
  // From synchronize() to synchronize(): the pipeline fills once and drains
  // once. A long run sees the steady state instead: the time between loss
  // returns (each is the same point of a call), which calls overlap into.
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double step_seconds =
      s.steps > 1 ? std::chrono::duration<double>(returned.back() - returned.front()).count() /
                        (s.steps - 1)
                  : seconds;
  int64_t params_up = 0, acts_up = 0, peak = 0, param_copies = 0, largest_copy = 0;
  for (int d = 0; d < pool.size() && d < 8; ++d) {
    const auto after = pool.at(d)->transfer_stats();
    params_up += after.param_upload_bytes - before[d].param_upload_bytes;
    acts_up += after.activation_upload_bytes - before[d].activation_upload_bytes;
    param_copies += after.param_upload_copies - before[d].param_upload_copies;
    largest_copy = std::max(largest_copy, after.largest_param_copy_bytes);
    peak = std::max(peak, pool.at(d)->memory_stats().peak_bytes);
  }
  const double tokens_per_step = static_cast<double>(s.batch) * s.seq;
  // Model FLOPs (no recompute): 2 forward, 2 input gradient, 2 weight
  // gradient per weight and token; frozen weights have no weight gradient.
  const int flops_per_weight = s.freeze_linear || s.lora_rank > 0 ? 4 : 6;
  const double tflops = flops_per_weight * linear * tokens_per_step / step_seconds / 1e12;
  const double h2d = (params_up + acts_up) / s.steps / step_seconds / 1e9 / pool.size();
  std::printf("train: %d timed steps in %.2fs, loss %.4f (sum over microbatches)\n", s.steps,
              seconds, loss.item<double>());
  std::printf(
      "  tokens/s                      %12.0f  (steady state: %.1f ms between loss returns)\n",
      tokens_per_step / step_seconds, step_seconds * 1000);
  std::printf("  tokens/s with fill and drain  %12.0f  (synchronize to synchronize)\n",
              tokens_per_step * s.steps / seconds);
  std::printf(
      "  linear TFLOP/s (%d x P x T)    %12.1f  = %.1f%% of the measured matmul rate per device\n",
      flops_per_weight, tflops, 100.0 * tflops / pool.size() / matmul);
  std::printf("  H2D bytes per iteration       %12.2f GiB (parameters %.2f, activations %.2f)\n",
              (params_up + acts_up) / s.steps / 1073741824.0, params_up / s.steps / 1073741824.0,
              acts_up / s.steps / 1073741824.0);
  std::printf("  parameter upload copies       %12.0f per iteration, the largest %.2f MiB\n",
              static_cast<double>(param_copies) / s.steps, largest_copy / 1048576.0);
  std::printf("  H2D GB/s per device (average) %12.1f  = %.1f%% of the measured copy rate\n", h2d,
              100.0 * h2d / copy);
  std::printf("  peak device memory            %12.3f GiB in the timed steps (warm-up: %.3f)\n",
              peak / 1073741824.0, warmup_peak / 1073741824.0);
  // Beside it, what the plan in use predicts for its largest stage (with
  // the next stage's parameters arriving), and how many calls or
  // microbatches ran out of memory (0: the plan fit from the first call on).
  try {
    const int n =
        s.microbatches > 0 ? s.microbatches : roundpipe::default_num_microbatch(pool.size());
    const auto plan = pipe->auto_plan(/*fused=*/true, n);
    int64_t predicted = 0;
    for (const auto& stage : plan.stages) predicted = std::max(predicted, stage.peak_bytes);
    std::printf("  the plan's predicted peak     %12.3f GiB (%s)\n", predicted / 1073741824.0,
                plan.plan.to_string().c_str());
  } catch (const std::exception& e) {
    std::printf("  the plan's predicted peak     (none: %s)\n", e.what());
  }
  std::printf("  out-of-memory recoveries      %12lld\n",
              static_cast<long long>(pipe->pipeline_stats().out_of_memory_recoveries));
  std::printf("  parameters %.1fM (linear %.1fM)\n", all / 1e6, linear / 1e6);
  // Host memory of the model state, staging copies and downloads (pin_model=alloc: one arena).
  const auto host = pipe->host_memory_stats();
  // The model state: the weights, and for each trainable parameter its fp32
  // master copy and two fp32 Adam moments (on the host, outside the arena).
  const double model_state = host.model_state_bytes + 12.0 * trainable;
  std::printf(
      "  host pinned bytes             %12.2f GiB = %.3f x the model state (%.2f GiB: weights, "
      "fp32 masters and moments), %.3f x the weights",
      host.arena.pinned_bytes / 1073741824.0, host.arena.pinned_bytes / model_state,
      model_state / 1073741824.0,
      static_cast<double>(host.arena.pinned_bytes) / std::max<int64_t>(host.model_state_bytes, 1));
  if (host.arena.pinned_bytes < host.arena.reserved_bytes) {
    std::printf(" (%.2f GiB of the arena unpinned)",
                (host.arena.reserved_bytes - host.arena.pinned_bytes) / 1073741824.0);
  }
  std::printf("\n");
  // What the pinned bytes hold: the weights (one exact chunk) and the
  // staging copies and download buffers, whose peak shows the arena's waste.
  std::printf(
      "  host arena                    %12.2f GiB reserved = %.3f x its peak live bytes "
      "(%.2f GiB: weights %.2f, staging + downloads %.2f)\n",
      host.arena.reserved_bytes / 1073741824.0,
      static_cast<double>(host.arena.reserved_bytes) /
          std::max<int64_t>(host.arena.peak_allocated_bytes, 1),
      host.arena.peak_allocated_bytes / 1073741824.0, host.model_state_bytes / 1073741824.0,
      (host.arena.peak_allocated_bytes - host.model_state_bytes) / 1073741824.0);
  // The process's peak resident memory (/proc's VmHWM): everything the host
  // holds, LibTorch's own included, as a user's `top` shows it; and the
  // resident memory along the way (on simulated devices, device memory is
  // host memory too).
  std::printf(
      "  host peak resident memory     %12.2f GiB (resident: %.2f with the model made, peak "
      "%.2f by then; %.2f wrapped; %.2f now)\n",
      status_gib("VmHWM"), rss_made, hwm_made, rss_wrapped, status_gib("VmRSS"));
  std::printf("  host resident memory by kind    %s\n", resident_by_kind().c_str());
  // What the threads waited for, per timed step: an optimizer slower than
  // the devices shows as workers waiting for weights.
  const auto waits = pipe->pipeline_stats();
  const double per_step = 1000.0 / s.steps;
  std::printf(
      "  per step (ms): optimizer update %.0f, its wait for gradients %.0f, publish %.0f; "
      "workers waiting for weights %.0f; call start waiting %.0f\n",
      (waits.optimizer_update_seconds - waits_before.optimizer_update_seconds) * per_step,
      (waits.optimizer_grad_wait_seconds - waits_before.optimizer_grad_wait_seconds) * per_step,
      (waits.optimizer_publish_seconds - waits_before.optimizer_publish_seconds) * per_step,
      (waits.weight_wait_seconds - waits_before.weight_wait_seconds) * per_step,
      (waits.call_start_wait_seconds - waits_before.call_start_wait_seconds) * per_step);
#ifdef ROUNDPIPE_WITH_CUDA
  if (s.profile_steps > 0 && device->torch_device().is_cuda())
    roundpipe_bench::profile_kernels(s.profile_steps, pool, run_step, step_seconds);
#endif
  pipe->synchronize();  // the queued steps use `adam`: done before it goes
  return 0;
}

// Doubles the sequence until a step fails for memory, then bisects.
int max_seq(Setup s) {
  auto config = roundpipe::models::CausalLMConfig::from_json_string(shape_json(s.shape), s.shape);
  roundpipe::models::CausalLM model(config, roundpipe::models::CausalLMOptions().set_dtype(
                                                roundpipe::dtype_from_string(s.dtype)));
#ifdef ROUNDPIPE_WITH_CUDA
  // The cap is real on a GPU: the caching allocator refuses beyond it (on
  // simulated devices give the budget in the spec, e.g. sim:1,mem=24GiB).
  if (s.memory_cap_gib > 0 && torch::cuda::is_available()) {
    (void)torch::empty({1}, torch::Device(torch::kCUDA, 0));  // the allocator exists from here
    const auto total = roundpipe::make_devices(s.devices.empty() ? "cuda" : s.devices)
                           .at(0)
                           ->memory_stats()
                           .budget_bytes;
    c10::cuda::CUDACachingAllocator::setMemoryFraction(s.memory_cap_gib * (1 << 30) / total, 0);
  }
#endif
  s.batch = 1;
  if (s.microbatches == 0) s.microbatches = 1;
  auto fits = [&](int64_t seq) {
    auto pipe = wrap(model, s);
    auto ids = torch::randint(0, config.vocab_size, {1, seq}, torch::kLong);
    try {
      pipe->forward_backward(c10::ivalue::Tuple::create({ids, c10::IValue(), ids}), c10::IValue(),
                             loss_of_output());
      pipe->synchronize();
      return true;
    } catch (const roundpipe::StageError& e) {
      if (!e.out_of_memory) throw;
      return false;
    }
  };
  int64_t good = 0, bad = 0;
  for (int64_t seq = s.seq_start; seq <= s.seq_limit; seq *= 2) {
    const bool ok = fits(seq);
    std::printf("  seq %7lld: %s\n", static_cast<long long>(seq), ok ? "fits" : "out of memory");
    if (!ok) {
      bad = seq;
      break;
    }
    good = seq;
  }
  while (bad > 0 && bad - good > 1024) {
    const int64_t mid = (good + bad) / 2 / 1024 * 1024;
    const bool ok = fits(mid);
    std::printf("  seq %7lld: %s\n", static_cast<long long>(mid), ok ? "fits" : "out of memory");
    (ok ? good : bad) = mid;
  }
  std::printf("max sequence length (batch 1, %s recompute, cap %.3g GiB): %s%lld tokens\n",
              s.recompute.c_str(), s.memory_cap_gib, bad == 0 ? ">= " : "",
              static_cast<long long>(good));
  if (bad == 0) std::printf("  (every length up to --seq-limit fits)\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"roundpipe-bench: throughput and ceilings of RoundPipe on the native Qwen3 preset"};
  Setup s;
  app.add_option("--shape", s.shape, "tiny, 32B-mini, 1.7B, 4B, 8B or 32B");
  app.add_option("--devices", s.devices,
                 "device spec (default: $ROUNDPIPE_DEVICES, else GPUs, else sim)");
  app.add_option("--dtype", s.dtype, "bfloat16, float16 or float32");
  app.add_option("--batch", s.batch, "sequences per iteration");
  app.add_option("--seq", s.seq, "tokens per sequence");
  app.add_option("--microbatches", s.microbatches,
                 "microbatches per iteration (default: devices + 1)");
  app.add_option("--warmup", s.warmup, "untimed iterations first");
  app.add_option("--steps", s.steps, "timed iterations");
  app.add_option("--recompute", s.recompute, "stage, layer or layer_from_stage");
  app.add_option("--memory-cap", s.memory_cap_gib,
                 "device memory limit in GiB (plan and --max-seq)");
  app.add_flag("--verbose", s.verbose, "log layer timings and the chosen plan");
  app.add_flag("--oom-census", s.oom_census,
               "CUDA: at each out-of-memory error, the allocated blocks by size");
  app.add_flag("--freeze-linear", s.freeze_linear,
               "freeze every 2-D weight (train the norms only): with a small batch the "
               "parameter uploads, not compute or the optimizer, set the pace");
  app.add_option("--lora-rank", s.lora_rank,
                 "LoRA adapters of this rank on every projection (alpha 2 r), the base frozen");
  app.add_option(
      "--quantize-base", s.quantize_base,
      "nf4, fp4, int8 or fp8: the base's projections quantized (QLoRA; with --lora-rank)");
  app.add_option("--profile", s.profile_steps,
                 "after timing, profile this many steps' kernels (CUDA only)");
  app.add_option("--seq-start", s.seq_start, "--max-seq: first length tried (doubling)");
  app.add_option("--seq-limit", s.seq_limit, "--max-seq: longest length tried");
  app.add_flag("--max-seq", s.max_seq, "search the longest sequence that trains (batch 1)");
  CLI11_PARSE(app, argc, argv);
  try {
    return s.max_seq ? max_seq(s) : train(s);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "roundpipe-bench: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "roundpipe-bench: %s\n", e.what());
    return 1;
  }
}

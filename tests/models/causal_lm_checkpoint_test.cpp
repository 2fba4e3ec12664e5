// Memory-mapped checkpoints: the weights stay the file's pages (no
// anonymous copy), also when LoRA trains on them with pin_model=off.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/safetensors.h>
#include <roundpipe/wrap.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <torch/cuda.h>

#include "test_util.h"

namespace roundpipe::testing {
namespace {
namespace fs = std::filesystem;
}  // namespace
}  // namespace roundpipe::testing

namespace roundpipe::testing {
namespace {

// This process's anonymous resident memory (Linux), in KiB.
int64_t anonymous_kib() {
#ifdef __GLIBC__
  // Freed heap memory goes back to the system first: left resident, a
  // later allocation reuses it unseen (a copy of the weights measured 14 of
  // 31 MiB after the mapped model's buffers were freed).
  malloc_trim(0);
#endif
  std::ifstream rollup("/proc/self/smaps_rollup");
  std::string key;
  int64_t value = 0;
  while (rollup >> key) {
    if (key == "Anonymous:") {
      rollup >> value;
      return value;
    }
    rollup.ignore(1 << 20, '\n');
  }
  return -1;
}

// The tiny config, wider: a checkpoint of 30+ MiB in a temporary directory.
// Returns its size in KiB.
int64_t write_wide_checkpoint(const fs::path& dir) {
  std::ifstream file(std::string(ROUNDPIPE_SOURCE_DIR) + "/configs/qwen3-tiny/config.json");
  std::string json((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  json = std::regex_replace(json, std::regex(R"("hidden_size": 128)"), R"("hidden_size": 512)");
  json = std::regex_replace(json, std::regex(R"("intermediate_size": 384)"),
                            R"("intermediate_size": 2048)");
  json = std::regex_replace(json, std::regex(R"("head_dim": 32)"), R"("head_dim": 128)");
  const auto config = models::CausalLMConfig::from_json_string(json, "the test's config");
  torch::manual_seed(0);
  models::CausalLM model(config);
  model.save_pretrained(dir.string());
  return static_cast<int64_t>(fs::file_size(dir / "model.safetensors")) / 1024;
}

// CausalLMOptions::map_weights: the weights are the checkpoint's mapped
// pages (file pages, not anonymous memory), equal to a copied load; a
// copied load grows anonymous memory by the checkpoint's size (which shows
// that the measure sees it).
TEST(CausalLMCheckpoint, MappedWeightsAreTheFilesPagesNotACopy) {
  if (anonymous_kib() < 0) GTEST_SKIP() << "no /proc/self/smaps_rollup";
  const auto dir = process_temp_dir() / "mapped";
  const int64_t checkpoint_kib = write_wide_checkpoint(dir);
  ASSERT_GT(checkpoint_kib, 30 * 1024);
  const auto ids = at::arange(16).reshape({2, 8});
  at::Tensor mapped_logits, copied_logits;
  {
    const int64_t before = anonymous_kib();
    auto mapped = models::CausalLM::from_pretrained(
        dir.string(), models::CausalLMOptions().set_map_weights(true));
    c10::NoGradGuard no_grad;
    mapped_logits = mapped.sequential()->forward<c10::IValue>(c10::IValue(ids)).toTensor();
    EXPECT_LT(anonymous_kib() - before, checkpoint_kib / 4)
        << "the mapped weights were copied into anonymous memory";
  }
  {
    const int64_t before = anonymous_kib();
    auto copied = models::CausalLM::from_pretrained(dir.string());
    c10::NoGradGuard no_grad;
    copied_logits = copied.sequential()->forward<c10::IValue>(c10::IValue(ids)).toTensor();
    EXPECT_GT(anonymous_kib() - before, checkpoint_kib / 2) << "the measure does not see a copy";
  }
  // The same weights; a GEMM may block differently on the mapped pages (the
  // file aligns tensors to 8 bytes only), so the same sums in another order.
  EXPECT_TENSOR_NEAR(mapped_logits, copied_logits, 1e-5, "mapped against copied weights");
  fs::remove_all(dir);
}

// The address ranges of this process's mappings of `file`.
std::vector<std::pair<uintptr_t, uintptr_t>> mappings_of(const fs::path& file) {
  std::vector<std::pair<uintptr_t, uintptr_t>> out;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.size() < file.string().size() ||
        line.compare(line.size() - file.string().size(), std::string::npos, file.string()) != 0)
      continue;
    const auto dash = line.find('-'), space = line.find(' ');
    out.emplace_back(std::stoull(line.substr(0, dash), nullptr, 16),
                     std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16));
  }
  return out;
}

// LoRA with pin_model=off from a checkpoint directory: the base weights
// stay the checkpoint's mapped pages while the adapters train (no arena,
// no copy), uploads go through the staging ring, and the losses are those
// of the same training with pin_model=alloc (the weights copied into the
// arena). (Resident memory is measured on the GPU, bench/lora_bench.py: a
// simulated device's memory is this process's own.)
TEST(CausalLMCheckpoint, LoraWithPinModelOffTrainsOnTheMappedPages) {
  const auto dir = process_temp_dir() / "off";
  write_wide_checkpoint(dir);
  models::CausalLMInput in;
  in.input_ids = at::randint(0, 256, {4, 16}, at::detail::createCPUGenerator(7));
  in.labels = in.input_ids;
  const LossFn loss_of = [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); };
  std::map<PinMode, std::vector<double>> losses;
  for (auto pin : {PinMode::kAlloc, PinMode::kOff}) {
    SCOPED_TRACE(pin == PinMode::kOff ? "off" : "alloc");
    auto wrapped = wrap_model_to_roundpipe(
        dir.string(),
        WrapOptions()
            .set_model(models::CausalLMOptions().set_lora(models::LoraOptions().set_rank(4)))
            .set_roundpipe(RoundPipeOptions().set_devices("sim:2").set_pin_model(pin)));
    auto& pipe = wrapped->pipe();
    {
      // The same A in both (the random draws before it differ: a mapped
      // load draws no initial base weights).
      c10::NoGradGuard no_grad;
      int64_t i = 0;
      for (auto& [name, p] : wrapped->model().hf_state_dict()) {
        if (name.find(".lora_A.") != std::string::npos)
          p.copy_(at::randn(p.sizes(), at::detail::createCPUGenerator(++i)) * 0.05);
      }
    }
    optim::Adam adam(pipe.optim_parameters(), optim::AdamConfig().set_lr(1e-2));
    for (int step = 0; step < 3; ++step) {
      auto result = pipe.forward_backward(in.to_ivalue(), c10::IValue(), loss_of, false,
                                          RunConfig().set_num_microbatch(2));
      losses[pin].push_back(result.loss.item<double>());
      pipe.step([&] {
        adam.step();
        adam.zero_grad();
      });
    }
    pipe.synchronize();
    const auto file = mappings_of(fs::canonical(dir / "model.safetensors"));
    int64_t mapped = 0, frozen = 0;
    for (const auto& [name, p] : wrapped->model().hf_state_dict()) {
      if (p.requires_grad()) continue;
      const auto at = reinterpret_cast<uintptr_t>(p.data_ptr());
      frozen += 1;
      mapped += std::any_of(file.begin(), file.end(),
                            [&](const auto& m) { return at >= m.first && at < m.second; });
    }
    EXPECT_GT(frozen, 0);
    EXPECT_EQ(mapped, pin == PinMode::kOff ? frozen : 0) << "frozen weights in the file's pages";
    EXPECT_EQ(pipe.host_memory_stats().arena.reserved_bytes > 0, pin == PinMode::kAlloc);
  }
  EXPECT_NE(losses[PinMode::kOff][0], losses[PinMode::kOff][2]) << "training changed nothing";
  for (int step = 0; step < 3; ++step)
    EXPECT_NEAR(losses[PinMode::kOff][step], losses[PinMode::kAlloc][step], 1e-6) << step;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace roundpipe::testing

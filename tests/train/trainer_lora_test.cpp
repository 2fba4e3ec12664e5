// roundpipe-train with LoRA, against peft and transformers: adapters in
// peft's layout or merged weights, on the experts too, with pin_model=off,
// and on a 4-bit base (QLoRA).
#include <gtest/gtest.h>
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/roundpipe.h>
#include <roundpipe/safetensors.h>
#include <roundpipe/train/data.h>
#include <roundpipe/train/token_file.h>
#include <roundpipe/train/trainer.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <regex>
#include <sstream>

#include "train/train_test_util.h"

namespace roundpipe::testing {
namespace {

namespace fs = std::filesystem;

// The loss of `ids` (labels = ids) from transformers + peft: the base
// checkpoint (`quantized` "4bit": by bitsandbytes, NF4 with double
// quantization, float32 compute; "8bit": its LLM.int8) with the adapter in
// `adapter` ("" for none), by the test's Python (scripts/setup.sh installs
// them).
double python_loss(const std::string& base, const std::string& adapter, const std::string& tag,
                   const std::string& quantized = "") {
  const auto printed = run_python(
      tag,
      "import sys, torch, transformers\n"
      "q = {'4bit': transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4',\n"
      "    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32),\n"
      "     '8bit': transformers.BitsAndBytesConfig(load_in_8bit=True)}.get(sys.argv[3])\n"
      "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], "
      "dtype=torch.float32,\n"
      "    **(dict(quantization_config=q, device_map='cpu') if q else {}))\n"
      "if sys.argv[2]:\n"
      "    import peft\n"
      "    model = peft.PeftModel.from_pretrained(model, sys.argv[2])\n"
      "ids = (torch.arange(24).reshape(2, 12) * 7 + 3) % 259\n"
      "with torch.no_grad():\n"
      "    print(float(model(input_ids=ids, labels=ids).loss), file=open(sys.argv[-1], 'w'))\n",
      base + " '" + adapter + "' '" + quantized + "'");
  double loss = NAN;
  std::istringstream(printed) >> loss;
  return loss;
}

// A random tiny Qwen3 checkpoint to fine-tune (seed 3), in a fresh directory.
std::string tiny_base_checkpoint(const std::string& name) {
  const std::string base = temp(name);
  fs::remove_all(base);
  torch::manual_seed(3);
  models::CausalLM model(models::CausalLMConfig::from_json_file(std::string(ROUNDPIPE_SOURCE_DIR) +
                                                                "/configs/qwen3-tiny/config.json"));
  model.save_pretrained(base);
  return base;
}

// LoRA with pin_model=off (the base checkpoint's mapped pages as the
// weights, uploads through the staging ring) resumes from a checkpoint to
// the same adapters as a run that was never stopped.
TEST(Trainer, LoraWithPinModelOffResumesExactly) {
  const std::string base = tiny_base_checkpoint("lora_resume_base");
  auto options = [&](const std::string& name) {
    auto o = tiny(name);
    o.model = base;
    o.pin = "off";
    o.steps = 8;
    o.lr = 1e-2;
    o.lora_rank = 4;
    o.overwrite = true;
    return o;
  };
  auto through = options("lora_through");
  through.checkpoint_every = 4;
  train::run_training(through);
  auto resumed = options("lora_resumed");
  resumed.resume = true;
  resumed.checkpoint_dir = through.output + ".ckpt";  // the step-4 checkpoint
  EXPECT_EQ(train::run_training(resumed).steps, 4) << "the resumed run trains the last 4 steps";
  const auto a = safetensors::load_file(through.output + "/adapter_model.safetensors");
  const auto b = safetensors::load_file(resumed.output + "/adapter_model.safetensors");
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  ASSERT_EQ(a.tensors.size(), 2u * 7 * 4) << "A and B of 7 projections in 4 layers";
  // The resumed run plans afresh, so its gradients may add the same terms
  // in another order (fp32: ~1e-6 relative); four Adam steps carry that
  // through. A lost optimizer state or step count is off by tens of percent.
  for (size_t i = 0; i < a.tensors.size(); ++i)
    EXPECT_TENSOR_NEAR(b.tensors[i].second, a.tensors[i].second, 1e-4, a.tensors[i].first);
}

// Trains `base` with LoRA (rank 4, alpha 8, 6 synchronous steps) on
// `targets` and `target_parameters` twice: writing the adapter, and with
// --merge the merged weights. peft loads the adapter onto the base with the
// same loss as transformers gets from the merged weights, and training
// moved the loss. Returns the two runs' options.
std::pair<train::TrainOptions, train::TrainOptions> train_lora_adapter_and_merged(
    const std::string& base, const std::string& name, const std::string& targets,
    const std::string& target_parameters) {
  auto options = [&](const std::string& what, bool merge) {
    auto o = tiny(name + "_" + what);
    o.model = base;
    o.steps = 6;
    o.lr = 1e-2;
    o.lora_rank = 4;
    o.lora_alpha = 8;
    o.lora_targets = targets;
    o.lora_target_parameters = target_parameters;
    o.merge = merge;
    o.sync_step = true;
    o.overwrite = true;
    return o;
  };
  const auto adapter = options("adapter", false), merged = options("merged", true);
  train::run_training(adapter);
  train::run_training(merged);
  const double base_loss = python_loss(base, "", name + "_base_loss");
  const double adapted = python_loss(base, adapter.output, name + "_adapted_loss");
  const double whole = python_loss(merged.output, "", name + "_merged_loss");
  EXPECT_GT(std::abs(adapted - base_loss), 1e-3) << "training changed nothing";
  EXPECT_NEAR(adapted, whole, 1e-4 * std::abs(whole));
  return {adapter, merged};
}

// roundpipe-train with --lora-rank: only the adapters train; the output is
// an adapter in peft's layout that peft loads onto the base checkpoint,
// and --merge writes merged full weights that transformers loads, with the
// same model (the same loss) as base + adapter.
TEST(Trainer, LoraWritesAPeftAdapterOrMergedWeights) {
  const std::string base = tiny_base_checkpoint("lora_base");
  const auto [adapter, merged] =
      train_lora_adapter_and_merged(base, "lora", "q_proj,v_proj,down_proj", "");
  EXPECT_TRUE(fs::exists(adapter.output + "/adapter_model.safetensors"));
  EXPECT_TRUE(fs::exists(adapter.output + "/adapter_config.json"));
  EXPECT_FALSE(fs::exists(adapter.output + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(merged.output + "/model.safetensors"));
  const auto keys = safetensors::load_file(adapter.output + "/adapter_model.safetensors");
  EXPECT_EQ(keys.tensors.size(), 2u * 3 * 4) << "A and B of 3 projections in 4 layers";
  auto merge_without_lora = tiny("bad");
  merge_without_lora.merge = true;
  EXPECT_THROW(train::validate(merge_without_lora), c10::Error);
}

// --quantize-base nf4 with --lora-rank (QLoRA): the base's projections in 4
// bits, quantized as the checkpoint loads, adapters trained on them; peft
// loads the adapter onto bitsandbytes' 4-bit quantization of the same base
// (the same codes, QuantizedBaseOracle) and moves its loss; the same with
// int8 and bitsandbytes' load_in_8bit. Without LoRA, with --merge, or in an
// unknown format: refused before training.
TEST(Trainer, QLoraTrainsAnAdapterOnA4BitBase) {
  const std::string base = tiny_base_checkpoint("qlora_base");
  auto o = tiny("qlora");
  o.model = base;
  o.steps = 6;
  o.lr = 1e-2;
  o.lora_rank = 4;
  o.lora_alpha = 8;
  o.quantize_base = "nf4";
  o.sync_step = true;
  train::run_training(o);
  EXPECT_TRUE(fs::exists(o.output + "/adapter_model.safetensors"));
  EXPECT_FALSE(fs::exists(o.output + "/model.safetensors"));
  const double before = python_loss(base, "", "qlora_base_loss", "4bit");
  const double after = python_loss(base, o.output, "qlora_adapted_loss", "4bit");
  EXPECT_GT(std::abs(after - before), 1e-3) << "training on the 4-bit base changed nothing";
  auto int8 = o;
  int8.quantize_base = "int8";
  int8.output = o.output + "_int8";
  train::run_training(int8);
  const double before8 = python_loss(base, "", "qlora8_base_loss", "8bit");
  const double after8 = python_loss(base, int8.output, "qlora8_adapted_loss", "8bit");
  EXPECT_GT(std::abs(after8 - before8), 1e-3) << "training on the 8-bit base changed nothing";
  auto bad = o;
  bad.lora_rank = 0;
  EXPECT_HAS(error_of([&] { train::validate(bad); }), "used with --lora-rank");
  bad = o;
  bad.merge = true;
  EXPECT_HAS(error_of([&] { train::validate(bad); }), "without --merge");
  bad = o;
  bad.quantize_base = "int4";
  EXPECT_HAS(error_of([&] { train::validate(bad); }), "nf4, fp4, int8 or fp8");
}

// roundpipe-train on a Qwen3-MoE model (layer 1 dense): the loss falls,
// and the saved checkpoint (experts per expert, as the hub's) loads back
// with the trained weights.
// A tiny Qwen3-MoE: 4 experts, 2 a token, layer 1 dense.
const char* const kTinyMoeConfig =
    R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 259, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 2,
    "norm_topk_prob": true, "mlp_only_layers": [1], "tie_word_embeddings": true,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})";

TEST(Trainer, TrainsAQwen3MoeModel) {
  const std::string config = temp("moe_config.json");
  std::ofstream(config) << kTinyMoeConfig;
  auto o = tiny("moe");
  o.config = config;
  o.steps = 60;
  o.log_every = 1;  // first_loss: the first step's
  o.lr = 1e-3;
  o.sync_step = true;
  o.overwrite = true;
  const auto s = train::run_training(o);
  EXPECT_LT(s.final_loss, 0.7 * s.first_loss) << s.first_loss << " -> " << s.final_loss;
  auto model = models::CausalLM::from_pretrained(o.output);
  EXPECT_EQ(model.config().model_type, "qwen3_moe");
  EXPECT_TRUE(fs::exists(o.output + "/model.safetensors"));
  const auto saved = safetensors::load_file(o.output + "/model.safetensors");
  bool per_expert = false;
  for (const auto& [name, t] : saved.tensors)
    per_expert |= name == "model.layers.0.mlp.experts.3.up_proj.weight";
  EXPECT_TRUE(per_expert) << "experts not saved one tensor per expert";
}

// --lora-target-parameters (Note [Expert LoRA]): adapters on both stacked
// expert weights and q_proj; peft loads the adapter onto the base (its
// nested names and target_parameters as peft writes them) with the same
// model (loss) as the merged weights transformers loads.
TEST(Trainer, LoraOnTheExpertsWritesAPeftAdapterOrMergedWeights) {
  const std::string base = temp("moe_lora_base");
  fs::remove_all(base);
  torch::manual_seed(3);
  models::CausalLM(models::CausalLMConfig::from_json_string(kTinyMoeConfig, "moe"))
      .save_pretrained(base);
  const auto [adapter, merged] = train_lora_adapter_and_merged(
      base, "moe_lora", "q_proj", "mlp.experts.gate_up_proj,mlp.experts.down_proj");
  const auto keys = safetensors::load_file(adapter.output + "/adapter_model.safetensors");
  EXPECT_EQ(keys.tensors.size(), 2u * (3 + 2 * 2)) << "A and B of q_proj in 3 layers and of 2 "
                                                      "expert weights in the 2 sparse layers";
  auto dense = tiny("moe_lora_dense");
  dense.lora_rank = 2;
  dense.lora_target_parameters = "mlp.experts.down_proj";  // the dense tiny Qwen3 has no experts
  EXPECT_THROW(train::run_training(dense), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing

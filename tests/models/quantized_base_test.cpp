// QLoRA in the presets (Note [4-bit base weights in the presets]): a model
// with CausalLMOptions::quantize_base computes what the plain model computes
// on its dequantized weights, through RoundPipe on simulated devices too,
// holds only the packed weights, quantizes a checkpoint as it reads it, and
// trains LoRA as peft does on bitsandbytes' quantization of the same base.
#include <gtest/gtest.h>
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/safetensors.h>

#include <filesystem>
#include <set>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

namespace fs = std::filesystem;
using models::CausalLM;
using models::CausalLMOptions;
using models::QuantType;

// Two Qwen3 layers whose projections span 32 to 128 blocks of 64 values.
models::CausalLMConfig small_qwen3() {
  return models::CausalLMConfig::from_json_string(
      R"({"model_type":"qwen3","vocab_size":50,"hidden_size":64,"intermediate_size":128,
          "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16})",
      "config.json");
}

CausalLMOptions lora_options() {
  return CausalLMOptions().set_lora(
      models::LoraOptions().set_rank(4).set_alpha(8).set_targets({"all-linear"}));
}

std::map<std::string, at::Tensor> lora_params(const CausalLM& model) {
  std::map<std::string, at::Tensor> found;
  for (const auto& [name, p] : model.hf_state_dict())
    if (CausalLM::is_lora_name(name)) found[name] = p;
  return found;
}

// Adapters away from their initialisation (B = 0 would hide A's gradient).
void randomize_adapters(CausalLM& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (auto& [name, p] : lora_params(model)) p.normal_(0, 0.1);
}

c10::IValue token_input(int64_t vocab) {
  models::CausalLMInput in;
  in.input_ids = (at::arange(24).reshape({2, 12}) * 7 + 3).remainder(vocab);
  in.labels = in.input_ids;
  return in.to_ivalue();
}

at::Tensor loss_of(CausalLM& model) {
  return model.sequential()->forward<c10::IValue>(token_input(model.vocab_size())).toTensor();
}

// A model with a 4-bit base, and the plain model on its dequantized weights
// (save_pretrained writes those) with the same adapters.
struct QuantizedAndPlain {
  CausalLM quantized, plain;
};

QuantizedAndPlain quantized_and_plain(QuantType type) {
  torch::manual_seed(3);
  CausalLM quantized(small_qwen3(), lora_options().set_quantize_base(type));
  randomize_adapters(quantized, 4);
  const auto dir = process_temp_dir() / (std::string("dequantized_") + models::to_string(type));
  quantized.save_pretrained(dir.string());
  auto plain = CausalLM::from_pretrained(dir.string(), lora_options());
  torch::NoGradGuard no_grad;
  auto theirs = lora_params(plain);
  for (const auto& [name, p] : lora_params(quantized)) theirs.at(name).copy_(p);
  return {std::move(quantized), std::move(plain)};
}

void expect_same_lora_grads(const CausalLM& ours, const CausalLM& oracle, double tol) {
  const auto theirs = lora_params(oracle);
  ASSERT_FALSE(theirs.empty());
  for (const auto& [name, p] : lora_params(ours))
    EXPECT_TENSOR_NEAR(p.grad(), theirs.at(name).grad(), tol, "gradient of " << name);
}

class QuantizedBase : public ::testing::TestWithParam<QuantType> {};

// The same fp32 products on the same weight values: equal to rounding.
TEST_P(QuantizedBase, ComputesWhatThePlainModelComputesOnItsDequantizedWeights) {
  auto [quantized, plain] = quantized_and_plain(GetParam());
  auto loss = loss_of(quantized), oracle = loss_of(plain);
  EXPECT_TENSOR_NEAR(loss, oracle, 1e-6, "loss");
  loss.backward();
  oracle.backward();
  expect_same_lora_grads(quantized, plain, 1e-6);
}

// On simulated devices the packed weights are what RoundPipe keeps and
// uploads: per projection of n values, n / 2 code bytes, n / 64 scale
// codes, 4 bytes a 256 scales, the 1 KiB map and the offset, instead of 4 n.
TEST_P(QuantizedBase, TrainsThroughRoundPipeHoldingOnlyThePackedWeights) {
  auto [quantized, plain] = quantized_and_plain(GetParam());
  RoundPipe pipe(quantized.sequential(), RoundPipeOptions().set_devices("sim:2,jitter_us=100"));
  const auto loss =
      pipe.forward_backward(
              token_input(quantized.vocab_size()), c10::IValue(),
              [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); }, false,
              RunConfig().set_num_microbatch(1))
          .loss;
  pipe.synchronize();
  auto oracle = loss_of(plain);
  oracle.backward();
  EXPECT_TENSOR_NEAR(loss, oracle, 1e-6, "loss");
  expect_same_lora_grads(quantized, plain, kGradError);

  int64_t plain_bytes = 0;
  std::set<const void*> seen;  // (a tied weight once)
  for (const auto& p : plain.sequential()->parameters())
    if (seen.insert(p.data_ptr()).second) plain_bytes += p.nbytes();
  int64_t saved = 0;
  const auto config = small_qwen3();
  const int64_t h = config.hidden_size, i = config.intermediate_size, d = config.head_dim;
  for (int64_t n : {h * 4 * d, h * 2 * d, h * 2 * d, 4 * d * h, h * i, h * i, i * h}) {
    const int64_t blocks = n / 64;
    saved += 4 * n - (n / 2 + blocks + 4 * ((blocks + 255) / 256) + 256 * 4 + 4);
  }
  saved *= config.num_hidden_layers;
  EXPECT_EQ(pipe.host_memory_stats().model_state_bytes, plain_bytes - saved);
}

// from_pretrained quantizes each projection of a full-precision checkpoint
// as it reads it: the codes quantize_4bit gives its tensor.
TEST_P(QuantizedBase, FromPretrainedQuantizesWhatItReads) {
  torch::manual_seed(5);
  CausalLM plain(small_qwen3());
  const auto dir = process_temp_dir() / "full_precision";
  plain.save_pretrained(dir.string());
  auto quantized =
      CausalLM::from_pretrained(dir.string(), CausalLMOptions().set_quantize_base(GetParam()));
  std::map<std::string, at::Tensor> ours;
  for (const auto& [name, p] : quantized.hf_state_dict()) ours[name] = p;
  int checked = 0;
  for (const auto& [name, w] : plain.hf_state_dict()) {
    if (name.find("_proj.weight") == std::string::npos) {
      EXPECT_TRUE(at::equal(ours.at(name), w)) << name << " is not a projection: kept as it is";
      continue;
    }
    const auto q = models::quantize_4bit(w, GetParam());
    EXPECT_TRUE(at::equal(ours.at(name), q.packed)) << name;
    EXPECT_TRUE(at::equal(ours.at(name + "_absmax"), q.absmax)) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 14);
  EXPECT_HAS(message_of([&] { quantized.merge_lora(); }), "(no error)");  // no adapters: nothing
  auto with_lora =
      CausalLM::from_pretrained(dir.string(), lora_options().set_quantize_base(GetParam()));
  EXPECT_HAS(message_of([&] { with_lora.merge_lora(); }), "Save the adapter");
}

INSTANTIATE_TEST_SUITE_P(Types, QuantizedBase, ::testing::Values(QuantType::kNF4, QuantType::kFP4),
                         [](const auto& info) { return models::to_string(info.param); });

// The adapters and their gradients as peft computes them on a model that
// transformers loads with bitsandbytes' 4-bit quantization of the same
// checkpoint (BitsAndBytesConfig(load_in_4bit=True, nf4, double quant),
// float32 compute, on the CPU): the same quantized base (our codes and
// scales are bitsandbytes', tests/python/test_quantized.py), so the loss and
// gradients differ only by the order of fp32 sums in attention (sdpa) and
// elsewhere, as the presets do against transformers (1e-4).
TEST(QuantizedBaseOracle, LoraMatchesPeftOnBitsandbytes) {
  torch::manual_seed(6);
  const auto base = process_temp_dir() / "qlora_base", adapter = process_temp_dir() / "qlora";
  CausalLM(small_qwen3()).save_pretrained(base.string());
  auto ours =
      CausalLM::from_pretrained(base.string(), lora_options().set_quantize_base(QuantType::kNF4));
  randomize_adapters(ours, 7);
  ours.save_adapter(adapter.string());
  RoundPipe pipe(ours.sequential(), RoundPipeOptions().set_devices("sim:2"));
  const auto loss =
      pipe.forward_backward(
              token_input(ours.vocab_size()), c10::IValue(),
              [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); }, false,
              RunConfig().set_num_microbatch(1))
          .loss;
  pipe.synchronize();
  run_python("qlora_peft",
             "import sys, torch, transformers, peft\n"
             "from safetensors.torch import save_file\n"
             "q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4',\n"
             "    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)\n"
             "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1],\n"
             "    quantization_config=q, device_map='cpu', dtype=torch.float32)\n"
             "model = peft.PeftModel.from_pretrained(model, sys.argv[2], is_trainable=True)\n"
             "ids = (torch.arange(24).reshape(2, 12) * 7 + 3) % model.config.vocab_size\n"
             "loss = model(input_ids=ids, labels=ids).loss\n"
             "loss.backward()\n"
             "out = {n.replace('base_model.model.', '').replace('.default', ''): p.grad\n"
             "       for n, p in model.named_parameters() if p.grad is not None}\n"
             "out['loss'] = loss.detach().reshape(1)\n"
             "save_file(out, sys.argv[-1])\n",
             base.string() + " " + adapter.string());
  const auto theirs =
      safetensors::load_file((process_temp_dir() / "qlora_peft.txt").string()).tensors;
  std::map<std::string, at::Tensor> grads(theirs.begin(), theirs.end());
  ASSERT_TRUE(grads.count("loss")) << "see qlora_peft.txt.log";
  EXPECT_TENSOR_NEAR(loss.reshape({1}), grads.at("loss"), 1e-4, "loss");
  const auto adapters = lora_params(ours);
  EXPECT_EQ(adapters.size() + 1, grads.size());
  for (const auto& [name, p] : adapters) {
    ASSERT_TRUE(grads.count(name)) << name << " has no gradient in peft";
    EXPECT_TENSOR_NEAR(p.grad(), grads.at(name), 1e-4, "gradient of " << name);
  }
}

}  // namespace
}  // namespace roundpipe::testing

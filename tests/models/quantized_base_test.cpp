// QLoRA in the presets (Note [Quantized base weights in the presets]): a model
// with CausalLMOptions::quantize_base computes what the plain model computes
// on its dequantized weights, through RoundPipe on simulated devices too,
// holds only the packed weights, quantizes a checkpoint as it reads it, and
// trains LoRA as peft does on bitsandbytes' quantization of the same base.
#include <gtest/gtest.h>
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/safetensors.h>
#include <torch/cuda.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

namespace fs = std::filesystem;
using models::CausalLM;
using models::CausalLMOptions;
using models::QuantType;

// A quantized base to test: its format and model.
struct Case {
  std::string name;
  QuantType type;
  bool double_quant = true;
  bool moe = false;  // a Qwen3-MoE model (its experts quantized too) instead of Qwen3
};

// Two Qwen3 layers whose projections span 32 to 128 blocks of 64 values;
// or Qwen3-MoE's: layer 0 sparse (4 experts, 2 a token: stacks of 128
// blocks), layer 1 dense.
models::CausalLMConfig small_model(const Case& c) {
  if (c.moe)
    return models::CausalLMConfig::from_json_string(
        R"({"model_type":"qwen3_moe","vocab_size":50,"hidden_size":64,"intermediate_size":128,
            "moe_intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":16,"num_experts":4,"num_experts_per_tok":2,
            "norm_topk_prob":true,"mlp_only_layers":[1]})",
        "config.json");
  return models::CausalLMConfig::from_json_string(
      R"({"model_type":"qwen3","vocab_size":50,"hidden_size":64,"intermediate_size":128,
          "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16})",
      "config.json");
}
models::CausalLMConfig small_qwen3() {
  return small_model({"nf4", QuantType::kNF4});
}

CausalLMOptions quantized_options(CausalLMOptions options, const Case& c) {
  return options.set_quantize_base(c.type).set_double_quant(c.double_quant);
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

QuantizedAndPlain quantized_and_plain(const Case& c) {
  torch::manual_seed(3);
  CausalLM quantized(small_model(c), quantized_options(lora_options(), c));
  randomize_adapters(quantized, 4);
  const auto dir = process_temp_dir() / ("dequantized_" + c.name);
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

class QuantizedBase : public ::testing::TestWithParam<Case> {};

// The bytes a quantized weight of n values in `rows` rows keeps (Note
// [4-bit base weights], Note [8-bit base weights]): 4 bits, n / 2 code
// bytes and a scale a block of 64 (double quantized: a byte, plus 4 bytes a
// 256 scales, the 1 KiB map and the offset; else 4 bytes); 8 bits, n bytes
// and 4 a row.
int64_t quantized_bytes(int64_t n, int64_t rows, const Case& c) {
  if (!models::is_4bit(c.type)) return n + 4 * rows;
  const int64_t blocks = n / 64;
  if (!c.double_quant) return n / 2 + 4 * blocks;
  return n / 2 + blocks + 4 * ((blocks + 255) / 256) + 256 * 4 + 4;
}

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
  // Each quantized weight: {values, rows}; 4 bytes a value in float32.
  const auto config = small_model(GetParam());
  const int64_t h = config.hidden_size, i = config.intermediate_size, d = config.head_dim;
  const int64_t e = config.num_experts, m = config.moe_intermediate_size;
  std::vector<std::pair<int64_t, int64_t>> weights;
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    weights.insert(weights.end(),
                   {{h * 4 * d, 4 * d}, {h * 2 * d, 2 * d}, {h * 2 * d, 2 * d}, {4 * d * h, h}});
    if (config.sparse_layer(layer))
      weights.insert(weights.end(), {{e * 2 * m * h, e * 2 * m}, {e * h * m, e * h}});
    else
      weights.insert(weights.end(), {{h * i, i}, {h * i, i}, {i * h, h}});
  }
  int64_t saved = 0;
  for (auto [n, rows] : weights) saved += 4 * n - quantized_bytes(n, rows, GetParam());
  EXPECT_EQ(pipe.host_memory_stats().model_state_bytes, plain_bytes - saved);
}

// from_pretrained quantizes each projection (and expert stack) of a
// full-precision checkpoint as it reads it: the codes and scales
// quantize_4bit or quantize_8bit give its tensor; so with a mapped
// checkpoint, and pinned.
TEST_P(QuantizedBase, FromPretrainedQuantizesWhatItReads) {
  const auto& c = GetParam();
  torch::manual_seed(5);
  CausalLM plain(small_model(c));
  const auto dir = process_temp_dir() / "full_precision";
  plain.save_pretrained(dir.string());
  auto quantized = CausalLM::from_pretrained(dir.string(), quantized_options({}, c));
  std::map<std::string, at::Tensor> ours;
  for (const auto& [name, p] : quantized.hf_state_dict()) ours[name] = p;
  int checked = 0;
  for (const auto& [name, w] : plain.hf_state_dict()) {
    const bool expert = name.find(".experts.") != std::string::npos;
    if (name.find("_proj.weight") == std::string::npos && !expert) {
      EXPECT_TRUE(at::equal(ours.at(name), w)) << name << " is not quantized: kept as it is";
      continue;
    }
    if (models::is_4bit(c.type)) {
      const auto q = models::quantize_4bit(w, c.type, 64, c.double_quant);
      EXPECT_TRUE(at::equal(ours.at(name).reshape(-1), q.packed)) << name;
      EXPECT_TRUE(at::equal(ours.at(name + "_absmax"), q.absmax)) << name;
      if (c.double_quant)
        EXPECT_TRUE(at::equal(ours.at(name + "_nested_absmax"), q.nested_absmax)) << name;
      else
        EXPECT_FALSE(ours.count(name + "_nested_absmax")) << name;
    } else {
      const auto q = models::quantize_8bit(w.reshape({-1, w.size(-1)}), c.type);
      EXPECT_TRUE(at::equal(ours.at(name).reshape(q.values.sizes()), q.values)) << name;
      EXPECT_TRUE(at::equal(ours.at(name + "_scale").reshape(-1), q.scale)) << name;
    }
    ++checked;
  }
  EXPECT_EQ(checked, c.moe ? 13 : 14);  // (MoE: 4 + 2 in layer 0, 4 + 3 in layer 1)
  // A mapped checkpoint (the other weights the file's pages) and pinned
  // memory give the same model.
  auto pinned = quantized_options({}, c);
  pinned.pin_memory = true;
  for (const auto& options : {quantized_options({}, c).set_map_weights(true), pinned}) {
    if (options.pin_memory && !torch::cuda::is_available()) continue;  // (pinning needs CUDA)
    const auto other = CausalLM::from_pretrained(dir.string(), options);
    for (const auto& [name, p] : other.hf_state_dict())
      EXPECT_TRUE(at::equal(p, ours.at(name)))
          << name << (options.pin_memory ? " pinned" : " mapped");
  }
  EXPECT_HAS(message_of([&] { quantized.merge_lora(); }), "(no error)");  // no adapters: nothing
  auto with_lora = CausalLM::from_pretrained(dir.string(), quantized_options(lora_options(), c));
  EXPECT_HAS(message_of([&] { with_lora.merge_lora(); }), "Save the adapter");
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizedBase,
                         ::testing::Values(Case{"nf4", QuantType::kNF4},
                                           Case{"fp4", QuantType::kFP4},
                                           Case{"nf4_single_scales", QuantType::kNF4, false},
                                           Case{"int8", QuantType::kInt8},
                                           Case{"fp8", QuantType::kFP8},
                                           Case{"moe_nf4", QuantType::kNF4, true, true},
                                           Case{"moe_int8", QuantType::kInt8, true, true}),
                         [](const auto& info) { return info.param.name; });

// The adapters and their gradients as peft computes them on a model that
// transformers loads with bitsandbytes' 4-bit quantization of the same
// checkpoint (BitsAndBytesConfig(load_in_4bit=True, nf4, double quant),
// float32 compute, on the CPU): the same quantized base (our codes and
// scales are bitsandbytes', tests/python/test_quantized.py), so the loss and
// gradients differ only by the order of fp32 sums in attention (sdpa) and
// elsewhere, as the presets do against transformers (1e-4). Each Linear4bit
// runs as a float32 Linear of bitsandbytes' own dequantization of its
// weight: its CPU 4-bit matmul need not be float32-exact (on an AVX-512
// BF16 CPU its LoRA gradients were 1% off those of its own dequantized
// weights, its loss 2e-5), which says nothing about ours.
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
             "import bitsandbytes as bnb\n"
             "from bitsandbytes.functional import dequantize_4bit\n"
             "for parent in list(model.modules()):\n"
             "    for name, child in list(parent.named_children()):\n"
             "        if isinstance(child, bnb.nn.Linear4bit):\n"
             "            w = dequantize_4bit(child.weight.data, child.weight.quant_state)\n"
             "            plain = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)\n"
             "            plain.weight = torch.nn.Parameter(w.float(), requires_grad=False)\n"
             "            setattr(parent, name, plain)\n"
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

// A checkpoint transformers saved from a model it loaded with bitsandbytes
// (Note [bitsandbytes checkpoints]; NF4 double-quantized, FP4 with float32
// scales, int8): with adapters the model keeps the checkpoint's format and
// tensors; without, it is read into full precision; either way its weights
// are bitsandbytes' own dequantization, bit for bit.
TEST(QuantizedBaseOracle, ReadsACheckpointBitsandbytesQuantized) {
  torch::manual_seed(8);
  const auto base = process_temp_dir() / "bnb_base", out = process_temp_dir() / "bnb_saved";
  CausalLM(small_qwen3()).save_pretrained(base.string());
  run_python("bnb_saved",
             "import sys, torch, transformers\n"
             "import bitsandbytes.functional as F\n"
             "from safetensors.torch import save_file\n"
             "B = transformers.BitsAndBytesConfig\n"
             "formats = {'nf4': B(load_in_4bit=True, bnb_4bit_quant_type='nf4',\n"
             "                    bnb_4bit_use_double_quant=True),\n"
             "           'fp4': B(load_in_4bit=True, bnb_4bit_quant_type='fp4'),\n"
             "           'int8': B(load_in_8bit=True)}\n"
             "for name, q in formats.items():\n"
             "    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1],\n"
             "        quantization_config=q, device_map='cpu', dtype=torch.float32)\n"
             "    model.save_pretrained(sys.argv[2] + '/' + name)\n"
             "    weights = {}\n"
             "    for n, m in model.named_modules():\n"
             "        w = getattr(m, 'weight', None)\n"
             "        if type(w).__name__ == 'Params4bit':\n"
             "            weights[n + '.weight'] = F.dequantize_4bit(w.data, w.quant_state)\n"
             "        elif type(w).__name__ == 'Int8Params':\n"
             "            weights[n + '.weight'] = F.int8_vectorwise_dequant(w.data, w.SCB)\n"
             "    save_file(weights, sys.argv[2] + '/' + name + '.dequantized')\n"
             "print('ok', file=open(sys.argv[-1], 'w'))\n",
             base.string() + " " + out.string());
  const std::pair<const char*, models::BaseQuantization> formats[] = {
      {"nf4", {QuantType::kNF4, true}},
      {"fp4", {QuantType::kFP4, false}},
      {"int8", {QuantType::kInt8, false}}};
  for (const auto& [name, format] : formats) {
    const auto dir = out / name;
    const auto theirs =
        safetensors::load_file((out / (std::string(name) + ".dequantized")).string());
    ASSERT_EQ(theirs.tensors.size(), 14u) << name << ": see bnb_saved.txt.log";
    auto adapted = CausalLM::from_pretrained(dir.string(), lora_options());
    ASSERT_TRUE(adapted.options().quantize_base.has_value()) << name;
    EXPECT_EQ(*adapted.options().quantize_base, format.type) << name;
    EXPECT_EQ(adapted.options().double_quant, format.double_quant) << name;
    // (Its tensors as the checkpoint stores them: no requantization.)
    const auto raw = safetensors::load_file((dir / "model.safetensors").string());
    for (const auto& [n, p] : adapted.hf_state_dict())
      if (theirs.tensors.end() != std::find_if(theirs.tensors.begin(), theirs.tensors.end(),
                                               [&](const auto& named) { return named.first == n; }))
        EXPECT_TRUE(at::equal(p, raw.get(n).reshape(p.sizes()))) << name << " " << n;
    const auto written = process_temp_dir() / (std::string("bnb_dequantized_") + name);
    adapted.save_pretrained(written.string());
    const auto ours = safetensors::load_file((written / "model.safetensors").string());
    const auto plain = CausalLM::from_pretrained(dir.string());
    EXPECT_FALSE(plain.options().quantize_base.has_value()) << name;
    std::map<std::string, at::Tensor> plain_weights;
    for (const auto& [n, p] : plain.hf_state_dict()) plain_weights[n] = p;
    for (const auto& [n, w] : theirs.tensors) {
      EXPECT_TRUE(at::equal(ours.get(n), w)) << name << " " << n << " (kept quantized)";
      EXPECT_TRUE(at::equal(plain_weights.at(n), w)) << name << " " << n << " (full precision)";
    }
  }
}

}  // namespace
}  // namespace roundpipe::testing

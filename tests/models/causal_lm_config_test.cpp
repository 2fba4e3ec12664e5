// The presets' configuration and checkpoints as a user meets them: the
// token-chunked MLP, config errors that name the field and the fix,
// missing and mismatched weights, saving beside other files, and
// wrap_model_to_roundpipe from a checkpoint.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <roundpipe/microbatch.h>
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

#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include "models/attention.h"
#include "models/hf_reference.h"
#include "test_util.h"

namespace roundpipe::testing {
namespace {

namespace fs = std::filesystem;

std::string config_error(const std::string& json) {
  try {
    models::CausalLMConfig::from_json_string(json, "config.json");
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "(accepted)";
}

// The token-chunked MLP (recomputed per chunk in backward) gives the
// unchunked model's loss and gradients, frozen weights included.
TEST(CausalLMChunkedMLP, MatchesUnchunkedWithFrozenWeights) {
  const auto config = models::CausalLMConfig::from_json_string(
      R"({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "tie_word_embeddings": false})",
      "tiny");
  auto run = [&](int64_t chunk) {
    torch::manual_seed(3);
    models::CausalLM model(config, models::CausalLMOptions()
                                       .set_dtype(at::kDouble)
                                       .set_mlp_chunk_tokens(chunk)
                                       .set_loss_chunk_tokens(7));
    for (auto& item : model.sequential()->named_parameters()) {
      if (item.key().find("1.mlp.gate_proj") == 0) item.value().requires_grad_(false);
    }
    auto ids = torch::randint(0, 64, {3, 11});
    auto loss = model.sequential()->forward<c10::IValue>(
        c10::IValue(c10::ivalue::Tuple::create({ids, c10::IValue(), ids})));
    loss.toTensor().backward();
    {
      // Without grad the chunks run as a plain loop: the same loss.
      torch::NoGradGuard no_grad;
      auto again = model.sequential()->forward<c10::IValue>(
          c10::IValue(c10::ivalue::Tuple::create({ids, c10::IValue(), ids})));
      EXPECT_NEAR(again.toTensor().item<double>(), loss.toTensor().item<double>(), 1e-12);
    }
    std::vector<std::pair<std::string, at::Tensor>> grads;
    for (const auto& item : model.sequential()->named_parameters())
      grads.emplace_back(item.key(), item.value().grad());
    return std::make_pair(loss.toTensor().item<double>(), grads);
  };
  const auto [plain_loss, plain] = run(0);
  const auto [chunked_loss, chunked] = run(5);  // 33 tokens: 7 chunks
  EXPECT_NEAR(chunked_loss, plain_loss, 1e-12);
  ASSERT_EQ(plain.size(), chunked.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    SCOPED_TRACE(plain[i].first);
    ASSERT_EQ(plain[i].second.defined(), chunked[i].second.defined());
    if (plain[i].first.find("1.mlp.gate_proj") == 0) EXPECT_FALSE(chunked[i].second.defined());
    if (plain[i].second.defined())
      EXPECT_TENSOR_NEAR(chunked[i].second, plain[i].second, 1e-10, "gradient");
  }
}

// A setting that changes the computation and that the presets do not
// implement is an error naming it, never a silent approximation.
TEST(CausalLMConfig, WhatThePresetsDoNotComputeIsAnError) {
  const std::string base = R"({"model_type":"qwen3","vocab_size":10,"hidden_size":8,
      "intermediate_size":8,"num_hidden_layers":3,"num_attention_heads":2)";
  EXPECT_NE(config_error(base + R"(,"hidden_act":"gelu"})").find("hidden_act 'gelu'"),
            std::string::npos);
  EXPECT_NE(config_error(base + R"(,"attention_dropout":0.1})").find("attention_dropout 0.1"),
            std::string::npos);
  EXPECT_NE(config_error(base + R"(,"pretraining_tp":2})").find("pretraining_tp 2"),
            std::string::npos);
  // (Each family's own fields: tests/models/families/.)
}

TEST(CausalLMConfig, ErrorsNameTheFieldAndTheFix) {
  EXPECT_NE(config_error("{").find("not valid JSON"), std::string::npos);
  const std::string moe =
      R"({"model_type":"qwen3_moe","vocab_size":10,"hidden_size":8,"intermediate_size":16,
          "num_hidden_layers":2,"num_attention_heads":2,"num_experts":4,"num_experts_per_tok":2,
          "moe_intermediate_size":4)";
  EXPECT_EQ(config_error(moe + "}"), "(accepted)");
  EXPECT_EQ(config_error(moe + R"(,"output_router_logits":true})"), "(accepted)");
  EXPECT_NE(config_error(moe + R"(,"router_aux_loss_coef":-1})").find("router_aux_loss_coef"),
            std::string::npos);
  EXPECT_NE(config_error(moe + R"(,"num_experts_per_tok":5})").find("num_experts_per_tok"),
            std::string::npos);
  EXPECT_NE(config_error(moe + R"(,"mlp_only_layers":["1"]})").find("list of whole numbers"),
            std::string::npos);
  EXPECT_NE(config_error(R"({"model_type":"qwen3","vocab_size":10})").find("'hidden_size'"),
            std::string::npos);
  EXPECT_NE(config_error(R"({"model_type":"llama","vocab_size":"ten"})").find("wrong type"),
            std::string::npos);
  // JSON numbers are not converted between kinds: 2.5 layers is an error.
  EXPECT_NE(config_error(R"({"model_type":"llama","vocab_size":10,"hidden_size":8,
      "intermediate_size":8,"num_hidden_layers":2.5,"num_attention_heads":2})")
                .find("'num_hidden_layers' has the wrong type: it must be a whole number"),
            std::string::npos);
  EXPECT_NE(config_error(R"({"model_type":"llama","vocab_size":10,"hidden_size":8,
      "intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":2,
      "tie_word_embeddings":1})")
                .find("'tie_word_embeddings' has the wrong type: it must be true or false"),
            std::string::npos);
  EXPECT_NE(
      config_error(R"({"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":8,
      "num_hidden_layers":1,"num_attention_heads":3,"num_key_value_heads":2})")
          .find("multiple of num_key_value_heads"),
      std::string::npos);
  EXPECT_NE(
      config_error(R"({"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":8,
      "num_hidden_layers":1,"num_attention_heads":2,"rope_scaling":{"rope_type":"dynamic"}})")
          .find("not supported"),
      std::string::npos);
}

TEST(CausalLMCheckpoint, MissingAndMismatchedWeightsGiveClearErrors) {
  const auto dir = reference_root() / "qwen3";
  const auto broken = process_temp_dir() / "qwen3_broken";
  fs::remove_all(broken);
  fs::create_directories(broken);
  fs::copy_file(dir / "config.json", broken / "config.json");
  auto what = [&] {
    try {
      models::CausalLM::from_pretrained(broken.string());
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  EXPECT_NE(what().find("expected model.safetensors"), std::string::npos);
  auto weights = safetensors::load_file((dir / "model.safetensors").string()).tensors;
  weights.pop_back();
  safetensors::save_file((broken / "model.safetensors").string(), weights);
  EXPECT_NE(what().find("has no tensor"), std::string::npos) << what();
  // An index may only name files in the checkpoint's own directory.
  for (const char* escape : {"../../../etc/passwd", "/etc/passwd", "sub/model.safetensors"}) {
    std::ofstream(broken / "model.safetensors.index.json")
        << R"({"weight_map": {"model.embed_tokens.weight": ")" << escape << R"("}})";
    EXPECT_NE(what().find("is not a file name in"), std::string::npos) << escape << ": " << what();
  }
}

// save_pretrained into a directory that holds other files: they stay, our
// files are replaced, and the shards of an earlier, sharded save go.
TEST(CausalLMCheckpoint, SavingKeepsOtherFilesAndDropsStaleShards) {
  auto model = models::CausalLM::from_pretrained((reference_root() / "qwen3").string());
  const auto out = process_temp_dir() / "qwen3_resaved";
  fs::remove_all(out);
  fs::create_directories(out);
  std::ofstream(out / "tokenizer.json") << "{}";
  model.save_pretrained((out.string() + "/"), /*max_shard_bytes=*/20000);  // trailing separator
  ASSERT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(out)) {
    shards += models::is_weight_file(entry.path().filename().string()) &&
              entry.path().filename() != "model.safetensors.index.json";
  }
  ASSERT_GT(shards, 1);
  model.save_pretrained(out.string());  // one file now
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(out)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{"config.json", "model.safetensors", "tokenizer.json"}));
  auto again = models::CausalLM::from_pretrained(out.string());
  EXPECT_TRUE(at::equal(again.hf_state_dict()[0].second, model.hf_state_dict()[0].second));
  // A regular file where the directory should be is refused, and left alone.
  const auto file = process_temp_dir() / "qwen3_not_a_dir";
  std::ofstream(file) << "mine";
  EXPECT_THROW(model.save_pretrained(file.string()), c10::Error);
  EXPECT_TRUE(fs::is_regular_file(file));
}

TEST(WrapModel, PresetFromACheckpointKeepsTheOriginalModelsAttributes) {
  const auto dir = reference_root() / "qwen3_tied_padded";
  auto wrapped = wrap_model_to_roundpipe(
      dir.string(), WrapOptions().set_roundpipe(RoundPipeOptions().set_devices("sim:2")));
  EXPECT_EQ(wrapped->config().model_type, "qwen3");
  EXPECT_EQ(wrapped->vocab_size(), 97);
  EXPECT_EQ(wrapped->pipe().num_layers(), 3 + 2);  // input adapter, 3 blocks, output adapter
  EXPECT_EQ(wrapped->pipe().name(), "qwen3");
  // One training step through the wrapper, then save_pretrained publishes it.
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  optim::Adam adam(wrapped->pipe().optim_parameters(), optim::AdamConfig().set_lr(1e-2));
  wrapped->pipe().forward_backward(
      model_input(ref), c10::IValue(),
      [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); });
  wrapped->pipe().step(adam);
  const auto out = process_temp_dir() / "wrapped_saved";
  wrapped->save_pretrained(out.string());
  auto reloaded = models::CausalLM::from_pretrained(out.string());
  auto before = models::CausalLM::from_pretrained(dir.string());
  EXPECT_FALSE(at::equal(reloaded.hf_state_dict()[0].second, before.hf_state_dict()[0].second))
      << "the saved weights include the step";
}

TEST(WrapModel, LoadsStraightIntoPinnedMemoryForGpus) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU";
  auto wrapped =
      wrap_model_to_roundpipe((reference_root() / "llama_padded").string(),
                              WrapOptions().set_roundpipe(RoundPipeOptions().set_devices("cuda")));
  for (const auto& p : wrapped->pipe().parameters()) EXPECT_TRUE(p.is_pinned());
}

TEST(WrapModel, PresetChoicesAndUnknownTypes) {
  const auto dir = reference_root() / "qwen3";
  auto what = [](auto&& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("(wrapped)");
  };
  EXPECT_NE(what([&] {
              wrap_model_to_roundpipe(dir.string(), WrapOptions().set_use_sequential_preset(false));
            }).find("automatic splitting"),
            std::string::npos);
  const auto other = process_temp_dir() / "gpt2_like";
  fs::create_directories(other);
  std::ofstream(other / "config.json") << R"({"model_type": "gpt2", "vocab_size": 10})";
  EXPECT_NE(what([&] {
              wrap_model_to_roundpipe(other.string());
            }).find("supported presets: qwen3, qwen3_moe, llama, gpt_oss"),
            std::string::npos);
  EXPECT_EQ(what([&] {
              wrap_model_to_roundpipe(dir.string(),
                                      WrapOptions().set_use_sequential_preset(true).set_roundpipe(
                                          RoundPipeOptions().set_devices("sim:1")));
            }),
            "(wrapped)");
}
}  // namespace
}  // namespace roundpipe::testing

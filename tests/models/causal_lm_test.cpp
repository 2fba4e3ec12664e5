// The native Qwen3 / Qwen3-MoE / Llama presets against HuggingFace
// transformers 5.17 (MoE: checkpoints with per-expert tensors, stacked here):
// logits, loss and parameter gradients (fp32, relative error <= 1e-4), plain
// and through RoundPipe, without padding, with right and left padding and
// with packed documents, tied and untied embeddings, Llama 3.1 rope scaling;
// the loss token-weighted over any number of microbatches; save_pretrained
// read back by transformers; attention sinks and MXFP4 experts.
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

class CausalLMTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CausalLMTest, PlainModelMatchesTransformers) {
  const auto dir = reference_root() / GetParam();
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  for (bool return_logits : {true, false}) {
    SCOPED_TRACE(return_logits ? "logits + loss"
                               : "fused chunked loss, MLP and experts in token chunks recomputed "
                                 "in backward");
    auto model = models::CausalLM::from_pretrained(
        dir.string(), models::CausalLMOptions()
                          .set_return_logits(return_logits)
                          .set_loss_chunk_tokens(5)
                          .set_mlp_chunk_tokens(return_logits ? 0 : 5)
                          .set_expert_chunk_tokens(return_logits ? 0 : 5));
    auto out = model.sequential()->forward<c10::IValue>(model_input(ref));
    at::Tensor loss;
    if (return_logits) {
      const auto& e = out.toTupleRef().elements();
      loss = e[0].toTensor();
      EXPECT_TENSOR_NEAR(token_logits(e[1].toTensor(), ref), token_logits(ref.get("logits"), ref),
                         kTol, "logits");
    } else {
      loss = out.toTensor();
    }
    EXPECT_TENSOR_NEAR(loss, ref.get("loss"), kTol, "loss");
    loss.backward();
    expect_grads(model, ref);
  }
}

TEST_P(CausalLMTest, ThroughRoundPipeMatchesTransformers) {
  const auto dir = reference_root() / GetParam();
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  std::vector<std::string> backends = {"sim:2,jitter_us=100", "sim:1"};
  if (cuda_device_count() > 0) backends.push_back("cuda");
  for (const auto& backend : backends) {
    SCOPED_TRACE(backend);
    auto model = models::CausalLM::from_pretrained(
        dir.string(), models::CausalLMOptions().set_return_logits(true));
    RoundPipe pipe(model.sequential(), RoundPipeOptions().set_devices(backend));
    // One microbatch: the loss is a mean over the batch's labelled tokens.
    auto result = pipe.forward_backward(
        model_input(ref), c10::IValue(),
        [](const c10::IValue& out, const c10::IValue&) {
          return out.toTupleRef().elements()[0].toTensor();
        },
        /*return_outputs=*/true,
        RunConfig().set_num_microbatch(1).set_execute_plan(
            ExecutePlan::one_layer_per_stage(pipe.num_layers(), true)));
    pipe.synchronize();
    EXPECT_TENSOR_NEAR(result.loss, ref.get("loss"), kTol, "loss");
    EXPECT_TENSOR_NEAR(token_logits(result.output.toTupleRef().elements()[1].toTensor(), ref),
                       token_logits(ref.get("logits"), ref), kTol, "logits");
    expect_grads(model, ref);
    // As many microbatches as rows: the logits do not depend on the split.
    torch::NoGradGuard no_grad;
    const int rows = static_cast<int>(ref.get("input_ids").size(0));
    auto out = pipe.forward(model_input(ref), RunConfig().set_num_microbatch(rows));
    EXPECT_TENSOR_NEAR(token_logits(out.toTupleRef().elements()[1].toTensor(), ref),
                       token_logits(ref.get("logits"), ref), kTol, "logits over microbatches");
  }
}

TEST_P(CausalLMTest, SavePretrainedLoadsInTransformers) {
  const auto dir = reference_root() / GetParam();
  auto model = models::CausalLM::from_pretrained(dir.string());
  std::string outs;
  for (int64_t shard : {int64_t{5} << 30, int64_t{20000}}) {  // single file and sharded
    const auto out = process_temp_dir() / (GetParam() + "_ours_" + std::to_string(shard));
    model.save_pretrained(out.string(), shard);
    EXPECT_EQ(fs::exists(out / "model.safetensors.index.json"), shard == 20000);
    outs += out.string() + " ";
    // Ours reads it back identically.
    auto again = models::CausalLM::from_pretrained(out.string());
    auto a = model.hf_state_dict(), b = again.hf_state_dict();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  }
  // Both load in transformers and give its logits.
  const auto log = process_temp_dir() / (GetParam() + "_check.log");
  const std::string cmd = std::string(ROUNDPIPE_PYTHON) + " " + ROUNDPIPE_SOURCE_DIR +
                          "/tests/models/hf_reference.py check " + outs + dir.string() + " > " +
                          log.string() + " 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "transformers rejected them:\n" << file_text(log);
}

INSTANTIATE_TEST_SUITE_P(Presets, CausalLMTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return info.param; });

// A padded batch split into microbatches: with the whole batch's token
// count as num_items_in_batch, the microbatch losses (which forward_backward
// sums) add up to transformers' loss on the whole batch, and so do the
// gradients, for any num_microbatch; forward() averages its microbatch
// outputs, so there the count is divided by num_microbatch.
TEST(CausalLMMasks, LossIsTokenWeightedOverAnyMicrobatchCount) {
  for (const std::string name : {"qwen3_left_padded", "llama_padded"}) {
    const auto dir = reference_root() / name;
    const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
    const auto whole = reference_input(ref);
    const int rows = static_cast<int>(whole.input_ids.size(0));
    const double items = static_cast<double>(models::count_loss_tokens(whole.labels));
    const LossFn loss_of = [](const c10::IValue& out, const c10::IValue&) {
      return out.toTensor();
    };
    for (int n : {1, 2, 4}) {
      if (n > rows) continue;
      SCOPED_TRACE(name + ", " + std::to_string(n) + " microbatches");
      auto model = models::CausalLM::from_pretrained(dir.string());
      RoundPipe pipe(model.sequential(), RoundPipeOptions().set_devices("sim:2"));
      auto in = whole;
      in.num_items_in_batch = items;
      auto result = pipe.forward_backward(in.to_ivalue(), c10::IValue(), loss_of, false,
                                          RunConfig().set_num_microbatch(n));
      pipe.synchronize();
      EXPECT_TENSOR_NEAR(result.loss, ref.get("loss"), kTol, "forward_backward loss");
      expect_grads(model, ref);
    }
    // forward() with autograd, 2 microbatches.
    auto model = models::CausalLM::from_pretrained(dir.string());
    RoundPipe pipe(model.sequential(), RoundPipeOptions().set_devices("sim:2"));
    auto in = whole;
    in.num_items_in_batch = items / 2;
    auto loss = pipe.forward(in.to_ivalue(), RunConfig().set_num_microbatch(2)).toTensor();
    EXPECT_TENSOR_NEAR(loss, ref.get("loss"), kTol, "forward loss");
    loss.backward();
    pipe.synchronize();
    expect_grads(model, ref);
    // Without the count each microbatch is its own mean: the rows hold
    // different numbers of tokens, so their sum is not the batch's loss
    // (what the cases are chosen to show).
    auto own = pipe.forward_backward(whole.to_ivalue(), c10::IValue(), loss_of, false,
                                     RunConfig().set_num_microbatch(2));
    pipe.synchronize();
    EXPECT_GT(std::abs(own.loss.item<double>() / 2 - ref.get("loss").item<double>()), 1e-3)
        << "the case does not tell token weighting from averaging microbatch means";
  }
}

// WrappedCausalLM::forward_backward counts the batch's labelled tokens
// itself: the loss and gradients are the whole batch's for any microbatch
// count.
TEST(CausalLMMasks, TheWrappersForwardBackwardIsTokenWeighted) {
  const auto dir = reference_root() / "qwen3_left_padded";
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  for (int n : {1, 2}) {
    SCOPED_TRACE(std::to_string(n) + " microbatches");
    auto wrapped = wrap_model_to_roundpipe(
        dir.string(), WrapOptions().set_roundpipe(RoundPipeOptions().set_devices("sim:2")));
    const auto loss =
        wrapped->forward_backward(reference_input(ref), RunConfig().set_num_microbatch(n));
    wrapped->pipe().synchronize();
    EXPECT_TENSOR_NEAR(loss, ref.get("loss"), kTol, "loss");
    expect_grads(wrapped->model(), ref);
  }
  auto wrapped = wrap_model_to_roundpipe(
      dir.string(), WrapOptions().set_roundpipe(RoundPipeOptions().set_devices("sim:1")));
  auto no_labels = reference_input(ref);
  no_labels.labels = at::Tensor();
  EXPECT_THROW(wrapped->forward_backward(no_labels), c10::Error);
}

// The model run on `in` layer by layer, its decoder layers' input split in
// `chunks` chunks of rows (1: whole): the chunks' losses added, logits
// concatenated, and the gradients of their sum.
struct ChunkedRun {
  at::Tensor loss, logits;
  std::vector<at::Tensor> grads;
};
ChunkedRun run_in_row_chunks(const fs::path& dir, const models::CausalLMInput& in, int chunks) {
  auto model = models::CausalLM::from_pretrained(dir.string(),
                                                 models::CausalLMOptions().set_return_logits(true));
  const auto seq = model.sequential();
  const auto layers = layers_of(seq);
  EXPECT_EQ(layers.front()->row_splitter(), nullptr) << "the input adapter does not split";
  std::vector<torch::nn::AnyModule> modules(seq->begin(), seq->end());
  std::vector<c10::IValue> parts{modules[0].forward<c10::IValue>(in.to_ivalue())};
  if (chunks > 1) {
    for (size_t l = 1; l < layers.size(); ++l)
      EXPECT_NE(layers[l]->row_splitter(), nullptr) << "layer " << l;
    parts = layers[1]->row_splitter()->split_input_rows(parts[0],
                                                        chunk_sizes(in.input_ids.size(0), chunks));
    EXPECT_EQ(parts.size(), static_cast<size_t>(chunks));
  }
  at::Tensor loss;
  std::vector<at::Tensor> logits;
  for (auto x : parts) {
    for (size_t l = 1; l < modules.size(); ++l) x = modules[l].forward<c10::IValue>(x);
    const auto& e = x.toTupleRef().elements();
    loss = loss.defined() ? loss + e[0].toTensor() : e[0].toTensor();
    logits.push_back(e[1].toTensor().detach());
  }
  loss.backward();
  ChunkedRun run{loss.detach(), at::cat(logits), {}};
  for (const auto& [name, p] : model.hf_state_dict()) run.grads.push_back(p.grad());
  return run;
}

// Note [Tail row chunks] (layer.h): the decoder layers' and output
// adapter's input split by rows and run chunk by chunk gives the whole
// batch's loss (the chunks' added), logits and gradients, for plain,
// padded (left, right), packed and sliding-window batches, with and
// without num_items_in_batch (a chunk then divides by the microbatch's
// count, not its own).
TEST(CausalLMRowChunks, ChunksOfRowsGiveTheWholeBatchsResults) {
  for (const auto& name : kCases) {
    if (has_router_loss(name)) continue;  // (CausalLMRouterLoss: never split)
    const auto dir = reference_root() / name;
    const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
    auto in = reference_input(ref);
    if (in.input_ids.size(0) == 1) {  // packed: two rows of documents
      in.input_ids = at::cat({in.input_ids, in.input_ids.roll(1, 1)});
      in.labels = at::cat({in.labels, in.labels});
      in.position_ids = at::cat({in.position_ids, in.position_ids});
    }
    const int rows = static_cast<int>(in.input_ids.size(0));
    for (bool counted : {false, true}) {
      in.num_items_in_batch.reset();
      if (counted) in.num_items_in_batch = 3.0 * models::count_loss_tokens(in.labels);
      const auto whole = run_in_row_chunks(dir, in, 1);
      for (int chunks : {2, rows}) {
        SCOPED_TRACE(::testing::Message() << name << ", " << chunks << " chunks"
                                          << (counted ? ", num_items_in_batch" : ""));
        const auto part = run_in_row_chunks(dir, in, chunks);
        EXPECT_TENSOR_NEAR(part.loss, whole.loss, kTol, "loss");
        EXPECT_TENSOR_NEAR(part.logits, whole.logits, kTol, "logits");
        for (size_t i = 0; i < whole.grads.size(); ++i)
          EXPECT_TENSOR_NEAR(part.grads[i], whole.grads[i], kTol, "gradient " << i);
      }
    }
  }
}

// Note [Router load-balancing loss]: one microbatch is transformers' loss
// (CausalLMTest); in two, each microbatch's statistics are its own and its
// router loss is weighted by its labelled tokens over num_items_in_batch,
// as hf_reference.py's two_microbatches computes with transformers. The
// layers then never split a microbatch's rows.
TEST(CausalLMRouterLoss, MicrobatchesWeightTheirOwnRouterLossByTokens) {
  const auto dir = reference_root() / "qwen3_moe_router_loss";
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  auto in = reference_input(ref);
  in.num_items_in_batch = static_cast<double>(models::count_loss_tokens(in.labels));
  auto model = models::CausalLM::from_pretrained(dir.string());
  const auto layers = layers_of(model.sequential());
  for (size_t l = 0; l < layers.size(); ++l)
    EXPECT_EQ(layers[l]->row_splitter(), nullptr) << "layer " << l << " splits rows";
  RoundPipe pipe(model.sequential(), RoundPipeOptions().set_devices("sim:2"));
  const auto result = pipe.forward_backward(
      in.to_ivalue(), c10::IValue(),
      [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); }, false,
      RunConfig().set_num_microbatch(2));
  pipe.synchronize();
  EXPECT_TENSOR_NEAR(result.loss, ref.get("two_microbatches.loss"), kTol, "loss");
  // (The two differ by 42% in the first router's gradient.)
  const std::string router = "grad.model.layers.0.mlp.gate.weight";
  EXPECT_GT(max_rel_error(ref.get("two_microbatches." + router), ref.get(router)), 0.05)
      << "the case does not tell the microbatches' statistics from the batch's";
  for (const auto& [name, p] : model.hf_state_dict())
    EXPECT_TENSOR_NEAR(p.grad(), ref.get("two_microbatches.grad." + name), kTol,
                       "gradient of " << name);
}

// Note [Expert routing]: the experts as one grouped product or a loop of
// per-expert products give transformers' results alike (the reference
// cases' shapes take the grouped path; CausalLMTest runs that), in token
// chunks too (Note [Expert token chunks]: 7 tokens a chunk leaves some
// experts without rows in a chunk).
TEST(CausalLMExperts, LoopedExpertsMatchTransformers) {
  for (const std::string name :
       {"qwen3_moe_padded", "qwen3_moe_router_loss_packed", "gpt_oss_left_padded"}) {
    for (int64_t chunk : {0, 7}) {
      SCOPED_TRACE(name + ", token chunks of " + std::to_string(chunk));
      const auto dir = reference_root() / name;
      const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
      auto model = models::CausalLM::from_pretrained(
          dir.string(),
          models::CausalLMOptions().set_grouped_experts(false).set_expert_chunk_tokens(chunk));
      auto loss = model.sequential()->forward<c10::IValue>(model_input(ref)).toTensor();
      EXPECT_TENSOR_NEAR(loss, ref.get("loss"), kTol, "loss");
      loss.backward();
      expect_grads(model, ref);
    }
  }
}

// Note [Attention sinks]: the flash kernels' output times sigmoid(lse -
// sink), with its backward through lse, against the scores formed
// explicitly here (softmax over the keys a query sees and the sink):
// output and the gradients of q, k, v and the sinks, with grouped heads,
// two sequences of a layout, with and without a window; on the CPU (its
// flash kernel, float32) and, where there is one, the GPU (bf16: 8 bits of
// mantissa, a few 1e-3 of each tensor's largest element).
TEST(AttentionSinks, FlashKernelsMatchTheScoresFormedExplicitly) {
  std::vector<std::pair<c10::Device, at::ScalarType>> backends = {{c10::kCPU, at::kFloat}};
  if (torch::cuda::is_available()) backends.emplace_back(c10::Device(c10::kCUDA, 0), at::kBFloat16);
  const int64_t H = 4, Hkv = 2, hd = 16, lengths[] = {7, 12};
  const double scale = 0.25;
  for (const auto& [device, dtype] : backends) {
    for (int64_t window : {0, 3}) {
      SCOPED_TRACE(::testing::Message() << device << ", window " << window);
      torch::manual_seed(11);
      const auto opts = at::TensorOptions().dtype(dtype).device(device);
      const int64_t N = lengths[0] + lengths[1];
      auto q = at::randn({1, N, H, hd}).to(opts).requires_grad_();
      auto k = at::randn({1, N, Hkv, hd}).to(opts).requires_grad_();
      auto v = at::randn({1, N, Hkv, hd}).to(opts).requires_grad_();
      auto sinks = at::randn({H}).to(opts).requires_grad_();
      const auto dy = at::randn({1, N, H, hd}).to(opts);
      models::SequenceLayout layout;
      layout.token_index = at::arange(N, at::TensorOptions().dtype(at::kLong).device(device));
      layout.cu_seqlens = at::tensor({0, static_cast<int>(lengths[0]), static_cast<int>(N)},
                                     at::TensorOptions().dtype(at::kInt))
                              .to(device);
      layout.max_seqlen = lengths[1];
      const auto out = models::causal_attention(q, k, v, layout, scale, window, sinks);
      const auto got = torch::autograd::grad({out}, {q, k, v, sinks}, {dy});
      // The oracle, in float32 on the CPU.
      std::vector<at::Tensor> x;
      for (const auto& t : {q, k, v, sinks})
        x.push_back(t.detach().to(at::kCPU, at::kFloat).requires_grad_());
      std::vector<at::Tensor> parts;
      int64_t start = 0;
      for (const int64_t len : lengths) {
        auto qs = x[0][0].narrow(0, start, len).transpose(0, 1);  // [H, len, hd]
        auto ks = x[1][0].narrow(0, start, len).transpose(0, 1).repeat_interleave(H / Hkv, 0);
        auto vs = x[2][0].narrow(0, start, len).transpose(0, 1).repeat_interleave(H / Hkv, 0);
        auto scores = at::matmul(qs, ks.transpose(1, 2)) * scale;
        const auto i = at::arange(len);
        const auto behind = i.unsqueeze(1) - i.unsqueeze(0);
        auto seen = behind.ge(0);
        if (window > 0) seen = seen.logical_and(behind.lt(window));
        scores = scores.masked_fill(seen.logical_not(), -INFINITY);
        const auto all = at::cat({scores, x[3].view({H, 1, 1}).expand({H, len, 1})}, -1);
        parts.push_back(at::matmul(at::softmax(all, -1).narrow(-1, 0, len), vs).transpose(0, 1));
        start += len;
      }
      const auto expected = at::cat(parts).unsqueeze(0);
      const auto want = torch::autograd::grad({expected}, x, {dy.to(at::kCPU, at::kFloat)});
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      EXPECT_TENSOR_NEAR(out.to(at::kCPU, at::kFloat), expected, tol, "output");
      const char* names[] = {"q", "k", "v", "sinks"};
      for (int j = 0; j < 4; ++j)
        EXPECT_TENSOR_NEAR(got[j].to(at::kCPU, at::kFloat), want[j], tol,
                           "gradient of " << names[j]);
    }
  }
}

// Note [MXFP4 experts]: a GPT-OSS checkpoint with MXFP4 experts loads
// dequantised to exactly what transformers dequantises them to, in bf16 or
// float32, and saves as plain weights without the quantization_config.
TEST(GptOss, Mxfp4ExpertsLoadAsTransformersDequantisesThem) {
  const auto dir = reference_root() / "gpt_oss_mxfp4";
  const auto ref = safetensors::load_file((dir / "mxfp4_reference.safetensors").string());
  ASSERT_EQ(ref.tensors.size(), 2u * 3) << "gate_up_proj and down_proj of 3 layers";
  for (const auto dtype : {at::kBFloat16, at::kFloat}) {
    auto model =
        models::CausalLM::from_pretrained(dir.string(), models::CausalLMOptions().set_dtype(dtype));
    const auto state = model.hf_state_dict();
    for (const auto& [name, expected] : ref.tensors) {
      const auto it = std::find_if(state.begin(), state.end(),
                                   [&](const auto& item) { return item.first == name; });
      ASSERT_NE(it, state.end()) << name;
      EXPECT_TRUE(at::equal(it->second, expected.to(dtype))) << name << " in " << dtype;
    }
    if (dtype != at::kFloat) continue;
    const auto out = process_temp_dir() / "gpt_oss_mxfp4_saved";
    model.save_pretrained(out.string());
    std::ifstream config(out / "config.json");
    const std::string text((std::istreambuf_iterator<char>(config)), {});
    EXPECT_EQ(text.find("quantization_config"), std::string::npos);
    EXPECT_NE(text.find("\"gpt_oss\""), std::string::npos);
    auto again = models::CausalLM::from_pretrained(out.string());
    const auto reloaded = again.hf_state_dict();
    ASSERT_EQ(reloaded.size(), state.size());
    for (size_t i = 0; i < state.size(); ++i)
      EXPECT_TRUE(at::equal(reloaded[i].second, state[i].second)) << state[i].first;
  }
}

// An all-ones mask, and position_ids 0..T-1, are the same as none: the same
// path, the same numbers to the bit.
TEST(CausalLMMasks, AllOnesMaskAndPlainPositionsTakeTheUnmaskedPath) {
  const auto dir = reference_root() / "qwen3";
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  auto model = models::CausalLM::from_pretrained(dir.string(),
                                                 models::CausalLMOptions().set_return_logits(true));
  torch::NoGradGuard no_grad;
  auto run = [&](const models::CausalLMInput& in) {
    return model.sequential()->forward<c10::IValue>(in.to_ivalue()).toTupleRef().elements();
  };
  const auto plain = reference_input(ref);
  auto ones = plain;
  ones.attention_mask = at::ones_like(plain.input_ids);
  auto positions = plain;
  positions.position_ids = at::arange(plain.input_ids.size(1)).unsqueeze(0);
  const auto expected = run(plain);
  for (const auto& [what, in] : {std::pair{"all-ones mask", ones}, {"positions", positions}}) {
    const auto got = run(in);
    EXPECT_TRUE(at::equal(got[0].toTensor(), expected[0].toTensor())) << what << ": loss";
    EXPECT_TRUE(at::equal(got[1].toTensor(), expected[1].toTensor())) << what << ": logits";
  }
}

std::vector<int64_t> as_vector(const at::Tensor& t) {
  const auto c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

TEST(CausalLMMasks, SequenceLayoutFollowsTransformersRules) {
  using V = std::vector<int64_t>;
  // Right, left and inner padding: one sequence per row of its tokens.
  const auto mask = at::tensor({1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1}, at::kLong).view({3, 4});
  auto layout = models::sequence_layout(mask, {}, 3, 4);
  ASSERT_TRUE(layout.has_value());
  EXPECT_EQ(as_vector(layout->token_index), (V{0, 1, 2, 5, 6, 7, 8, 10, 11}));
  EXPECT_EQ(as_vector(layout->cu_seqlens), (V{0, 3, 6, 9}));
  EXPECT_EQ(layout->max_seqlen, 3);
  EXPECT_EQ(layout->cu_seqlens.scalar_type(), at::kInt);
  // Packed documents: a row splits where positions do not follow on; one
  // [1, T] row of positions serves every row.
  const auto packed = at::tensor({0, 1, 2, 0, 1, 0}, at::kLong).view({1, 6});
  layout = models::sequence_layout({}, packed, 2, 6);
  ASSERT_TRUE(layout.has_value());
  EXPECT_EQ(as_vector(layout->cu_seqlens), (V{0, 3, 5, 6, 9, 11, 12}));
  EXPECT_EQ(layout->token_index.numel(), 12);
  EXPECT_EQ(layout->max_seqlen, 3);
  // No layout: no inputs, an all-ones mask (position_ids are then not
  // looked at, as in transformers), positions that run on in every row.
  EXPECT_FALSE(models::sequence_layout({}, {}, 2, 6).has_value());
  EXPECT_FALSE(models::sequence_layout(at::ones({2, 6}), packed, 2, 6).has_value());
  EXPECT_FALSE(models::sequence_layout({}, at::arange(3, 9).view({1, 6}), 2, 6).has_value());
  // A mask of the wrong shape names the fix.
  try {
    models::sequence_layout(at::ones({2, 1, 6, 6}), {}, 2, 6);
    ADD_FAILURE() << "a 4D mask was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("pass the 2D one"), std::string::npos) << e.what();
  }
}
}  // namespace
}  // namespace roundpipe::testing

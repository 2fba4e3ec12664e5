// The native Qwen3 / Qwen3-MoE / Llama presets against HuggingFace
// transformers 5.17 (MoE: checkpoints with per-expert tensors, stacked here):
// logits, loss and parameter gradients (fp32, relative error <= 1e-4), plain
// and through RoundPipe, without padding, with right and left padding and
// with packed documents, tied and untied embeddings, Llama 3.1 rope scaling;
// the loss token-weighted over any number of microbatches; save_pretrained
// read back by transformers; config errors.
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
#include "test_util.h"

namespace roundpipe::testing {
namespace {

namespace fs = std::filesystem;
// fp32 against transformers: the same products summed in another order
// (matmul blocking, attention over a sequence's own keys instead of a
// masked row of the whole batch's), a few ulps of each tensor's largest
// element; 1e-4 leaves room for the 3-layer model's growth of them.
constexpr double kTol = 1e-4;

std::string file_text(const fs::path& path) {
  std::ifstream file(path);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

// Made by transformers (tests/models/hf_reference.py) once per build tree
// and shared by the test processes: CTest runs each test in a process of
// its own, and making it takes ~25 s. The first process makes it under a
// file lock while the others wait; it is made again when the script or the
// Python changes (its stamp).
const fs::path& reference_root() {
  static const fs::path root = [] {
    const fs::path dir = fs::path(ROUNDPIPE_BINARY_DIR) / "hf_reference";
    const std::string script = std::string(ROUNDPIPE_SOURCE_DIR) + "/tests/models/hf_reference.py";
    const std::string stamp =
        std::to_string(std::hash<std::string>{}(file_text(script) + ROUNDPIPE_PYTHON));
    const std::string lock_path = dir.string() + ".lock";
    const int lock = ::open(lock_path.c_str(), O_CREAT | O_RDWR, 0644);
    if (lock < 0 || ::flock(lock, LOCK_EX) != 0)
      ADD_FAILURE() << "cannot lock " << lock_path << ": " << std::strerror(errno);
    if (file_text(dir / "stamp") != stamp) {
      fs::remove_all(dir);
      const std::string cmd = std::string(ROUNDPIPE_PYTHON) + " " + script + " make " +
                              dir.string() + " > " + dir.string() + ".log 2>&1";
      if (std::system(cmd.c_str()) == 0) {
        std::ofstream(dir / "stamp") << stamp;
      } else {
        ADD_FAILURE() << "could not make the transformers reference (is transformers==5.17.0 "
                         "installed? scripts/setup.sh installs it):\n"
                      << file_text(dir.string() + ".log");
      }
    }
    if (lock >= 0) ::close(lock);  // releases the lock
    return dir;
  }();
  return root;
}

// The reference cases of hf_reference.py, by their inputs.
const std::vector<std::string> kCases = {"qwen3",
                                         "qwen3_tied_padded",
                                         "llama_padded",
                                         "llama31_tied",
                                         "qwen3_left_padded",
                                         "llama31_left_padded",
                                         "qwen3_packed",
                                         "llama_packed",
                                         "qwen3_sliding",
                                         "qwen3_sliding_left",
                                         "qwen3_sliding_packed",
                                         "qwen3_moe_padded",
                                         "qwen3_moe_packed",
                                         "qwen3_moe_router_loss",
                                         "qwen3_moe_router_loss_packed",
                                         "gpt_oss_left_padded",
                                         "gpt_oss_router_loss"};

bool has_router_loss(const std::string& name) {
  return name.find("router_loss") != std::string::npos;
}

at::Tensor maybe(const safetensors::File& ref, const std::string& name) {
  for (const auto& [n, t] : ref.tensors) {
    if (n == name) return t;
  }
  return {};
}

models::CausalLMInput reference_input(const safetensors::File& ref) {
  models::CausalLMInput in;
  in.input_ids = ref.get("input_ids");
  in.attention_mask = maybe(ref, "attention_mask");
  in.position_ids = maybe(ref, "position_ids");
  in.labels = ref.get("labels");
  return in;
}

c10::IValue model_input(const safetensors::File& ref) {
  return reference_input(ref).to_ivalue();
}

// Logits where there is a token: at padding positions attention is zero
// here, as in transformers' flash_attention_2, but not in its sdpa path
// (models/attention.h).
at::Tensor token_logits(const at::Tensor& logits, const safetensors::File& ref) {
  const auto mask = maybe(ref, "attention_mask");
  return mask.defined() ? logits.index({mask.to(at::kBool)}) : logits;
}

void expect_grads(const models::CausalLM& model, const safetensors::File& ref) {
  for (const auto& [name, p] : model.hf_state_dict()) {
    EXPECT_TENSOR_NEAR(p.grad(), ref.get("grad." + name), kTol, "gradient of " << name);
  }
}

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

// LoRA on the presets (LoraOptions): the adapters start as the base model
// (B = 0: transformers' loss), only they train, and through RoundPipe their
// gradients are plain LibTorch's on the same model; base weights get no
// gradient and no optimizer copy. With LoRA dropout the layers do not split
// rows (it draws random numbers).
TEST(CausalLMLora, OnlyTheAdaptersTrainLikePlainLibTorch) {
  const auto dir = reference_root() / "qwen3_left_padded";
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  auto in = reference_input(ref);
  in.num_items_in_batch = static_cast<double>(models::count_loss_tokens(in.labels));
  // The output is (loss, logits): the logits show that the adapters act.
  const auto loss_in = [](const c10::IValue& out) {
    return out.toTupleRef().elements()[0].toTensor();
  };
  const LossFn loss_of = [&](const c10::IValue& out, const c10::IValue&) { return loss_in(out); };
  for (const std::vector<std::string>& targets :
       {std::vector<std::string>{}, std::vector<std::string>{"q_proj", "v_proj", "down_proj"}}) {
    SCOPED_TRACE(targets.empty() ? "all-linear" : "q, v, down");
    const auto options =
        models::CausalLMOptions()
            .set_lora(models::LoraOptions().set_rank(4).set_alpha(16).set_targets(targets))
            .set_return_logits(true);
    auto model = models::CausalLM::from_pretrained(dir.string(), options);
    auto plain = models::CausalLM::from_pretrained(dir.string(), options);
    {
      c10::NoGradGuard no_grad;
      EXPECT_TENSOR_NEAR(loss_in(plain.sequential()->forward<c10::IValue>(in.to_ivalue())),
                         ref.get("loss"), kTol, "loss with fresh adapters (the base model's)");
      // Non-zero B (the same in both), so that A's gradients show too.
      auto theirs = plain.hf_state_dict();
      auto ours = model.hf_state_dict();
      for (size_t i = 0; i < ours.size(); ++i) {
        if (ours[i].first.find(".lora_B.") == std::string::npos) {
          theirs[i].second.copy_(ours[i].second);  // A's random start, and the base
          continue;
        }
        auto values = at::randn(ours[i].second.sizes(), at::detail::createCPUGenerator(i));
        ours[i].second.copy_(values);
        theirs[i].second.copy_(values);
      }
    }
    size_t adapters = 0;
    for (const auto& [name, p] : model.hf_state_dict()) {
      const bool lora = models::CausalLM::is_lora_name(name);
      adapters += lora;
      EXPECT_EQ(p.requires_grad(), lora) << name;
    }
    EXPECT_EQ(adapters, 2 * 3 * (targets.empty() ? 7 : 3)) << "3 layers";
    RoundPipe pipe(model.sequential(), RoundPipeOptions().set_devices("sim:2"));
    EXPECT_EQ(pipe.optim_parameters().size(), adapters) << "masters for the adapters only";
    const auto result = pipe.forward_backward(in.to_ivalue(), c10::IValue(), loss_of, false,
                                              RunConfig().set_num_microbatch(2));
    pipe.synchronize();
    const auto out = plain.sequential()->forward<c10::IValue>(in.to_ivalue());
    auto loss = loss_in(out);
    loss.backward();
    // Not the loss: a random change of the model can leave it where it was
    // (CI once saw 5.8e-4); the logits move by B A x * alpha / rank, of the
    // order of the logits themselves with B ~ N(0, 1) (160-220% measured).
    EXPECT_GT(testing::max_rel_error(token_logits(out.toTupleRef().elements()[1].toTensor(), ref),
                                     token_logits(ref.get("logits"), ref)),
              0.01)
        << "the adapters change nothing";
    EXPECT_TENSOR_NEAR(result.loss, loss, kTol, "loss");
    const auto theirs = plain.hf_state_dict();
    const auto ours = model.hf_state_dict();
    for (size_t i = 0; i < ours.size(); ++i) {
      if (!models::CausalLM::is_lora_name(ours[i].first)) {
        EXPECT_FALSE(ours[i].second.grad().defined()) << ours[i].first;
        continue;
      }
      EXPECT_TENSOR_NEAR(ours[i].second.grad(), theirs[i].second.grad(), kTol,
                         "gradient of " << ours[i].first);
    }
  }
  auto dropping = models::CausalLM::from_pretrained(
      dir.string(),
      models::CausalLMOptions().set_lora(models::LoraOptions().set_rank(2).set_dropout(0.1)));
  EXPECT_EQ(layers_of(dropping.sequential())[1]->row_splitter(), nullptr);
  EXPECT_THROW(models::CausalLM::from_pretrained(
                   dir.string(), models::CausalLMOptions().set_lora(
                                     models::LoraOptions().set_rank(2).set_targets({"lm_head"}))),
               c10::Error);
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

// Note [Expert LoRA]: adapters on the experts' stacked weights, grouped or
// looped, through RoundPipe or plain, give one result (peft's: the Python
// tests); rank 3 makes the adapter's products too narrow for _grouped_mm
// (12-byte rows), rank 4 takes it; in token chunks (Note [Expert token
// chunks]) too.
TEST(CausalLMLora, ExpertAdaptersGroupedOrLoopedAgree) {
  const auto dir = reference_root() / "qwen3_moe_padded";
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  auto in = reference_input(ref);
  in.num_items_in_batch = static_cast<double>(models::count_loss_tokens(in.labels));
  for (int64_t rank : {3, 4}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    struct Run {
      at::Tensor loss;
      std::vector<at::Tensor> grads;
    };
    auto run = [&](bool grouped, bool pipelined, int64_t chunk = 0) {
      auto options = models::CausalLMOptions()
                         .set_grouped_experts(grouped)
                         .set_expert_chunk_tokens(chunk)
                         .set_lora(models::LoraOptions()
                                       .set_rank(rank)
                                       .set_alpha(8)
                                       .set_targets({"q_proj"})
                                       .set_target_parameters(
                                           {"mlp.experts.gate_up_proj", "experts.down_proj"}));
      auto model = models::CausalLM::from_pretrained(dir.string(), options);
      {
        c10::NoGradGuard no_grad;
        torch::manual_seed(7);
        for (auto& [name, p] : model.hf_state_dict())
          if (name.find(".lora_") != std::string::npos) p.copy_(at::randn(p.sizes()) * 0.1);
      }
      Run r;
      if (pipelined) {
        RoundPipe pipe(model.sequential(), RoundPipeOptions().set_devices("sim:2"));
        r.loss = pipe.forward_backward(
                         in.to_ivalue(), c10::IValue(),
                         [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); },
                         false, RunConfig().set_num_microbatch(2))
                     .loss;
        pipe.synchronize();
      } else {
        r.loss = model.sequential()->forward<c10::IValue>(in.to_ivalue()).toTensor();
        r.loss.backward();
        // Merged into the experts' weights (which it changes), the same model.
        const auto before = model.hf_state_dict();
        std::vector<at::Tensor> weights;
        for (const auto& [name, p] : before) weights.push_back(p.detach().clone());
        model.merge_lora();
        c10::NoGradGuard no_grad;
        const auto merged = model.sequential()->forward<c10::IValue>(in.to_ivalue()).toTensor();
        EXPECT_LE(max_rel_error(merged, r.loss), kTol) << "loss after merge_lora";
        for (size_t i = 0; i < before.size(); ++i)
          if (before[i].first.find("experts.gate_up_proj") != std::string::npos ||
              before[i].first.find("experts.down_proj") != std::string::npos)
            EXPECT_GT(max_rel_error(before[i].second, weights[i]), 0.1)
                << before[i].first << ": the adapter changes nothing";
      }
      for (auto& [name, p] : model.hf_state_dict()) {
        if (name.find(".experts.lora_A.") != std::string::npos ||
            name.find(".experts.base_layer.lora_B.") != std::string::npos)
          EXPECT_TRUE(p.grad().defined()) << name;
        if (p.grad().defined()) r.grads.push_back(p.grad());
      }
      return r;
    };
    const auto plain = run(false, false);
    EXPECT_EQ(plain.grads.size(), 2u * (3 + 2 * 2)) << "q_proj in 3 layers, 2 weights in 2 sparse";
    struct Variant {
      bool grouped, pipelined;
      int64_t chunk;  // Note [Expert token chunks]
    };
    for (auto [grouped, pipelined, chunk] : {Variant{true, false, 0}, Variant{true, true, 0},
                                             Variant{false, false, 5}, Variant{true, true, 3}}) {
      SCOPED_TRACE(std::string(grouped ? "grouped" : "looped") +
                   (pipelined ? ", through RoundPipe" : "") + ", token chunks of " +
                   std::to_string(chunk));
      const auto other = run(grouped, pipelined, chunk);
      EXPECT_TENSOR_NEAR(other.loss, plain.loss, kTol, "loss");
      ASSERT_EQ(other.grads.size(), plain.grads.size());
      for (size_t i = 0; i < plain.grads.size(); ++i)
        EXPECT_TENSOR_NEAR(other.grads[i], plain.grads[i], kTol, "gradient " << i);
    }
  }
  EXPECT_THROW(
      models::CausalLM::from_pretrained(
          dir.string(),
          models::CausalLMOptions().set_lora(
              models::LoraOptions().set_rank(2).set_target_parameters({"mlp.experts.up_proj"}))),
      c10::Error);
}

// Note [LoRA compute dtype]: on a bf16 base with float32 adapters (peft's
// layout) the adapter path runs in bf16 and its gradients reach the float32
// factors. Against the same model wholly in float32 the difference is the
// bf16 model's rounding: 8 bits of mantissa (3.9e-3 per value) compounded
// through three layers' norms and attention, to 4-14% of the largest
// gradient measured over runs and thread counts (the bf16 sums' order
// varies with them); 0.3 leaves room for that and still fails a lost or
// miscast gradient, off by 100%.
TEST(CausalLMLora, AdaptersOnAHalfPrecisionBaseComputeInItsDtype) {
  const auto dir = reference_root() / "qwen3_left_padded";
  const auto ref = safetensors::load_file((dir / "reference.safetensors").string());
  auto in = reference_input(ref);
  auto lora = models::LoraOptions().set_rank(4).set_alpha(16);
  lora.dtype = c10::kFloat;
  auto half = models::CausalLM::from_pretrained(
      dir.string(), models::CausalLMOptions().set_dtype(at::kBFloat16).set_lora(lora));
  auto full =
      models::CausalLM::from_pretrained(dir.string(), models::CausalLMOptions().set_lora(lora));
  {
    c10::NoGradGuard no_grad;
    auto ours = half.hf_state_dict(), theirs = full.hf_state_dict();
    for (size_t i = 0; i < ours.size(); ++i) {
      // The float32 model gets the bf16 model's weights; B non-zero.
      if (ours[i].first.find(".lora_B.") != std::string::npos)
        ours[i].second.copy_(at::randn(ours[i].second.sizes(), at::detail::createCPUGenerator(i)) *
                             0.05);
      theirs[i].second.copy_(ours[i].second);
    }
  }
  auto loss_half = half.sequential()->forward<c10::IValue>(in.to_ivalue()).toTensor();
  auto loss_full = full.sequential()->forward<c10::IValue>(in.to_ivalue()).toTensor();
  loss_half.backward();
  loss_full.backward();
  EXPECT_TENSOR_NEAR(loss_half.to(at::kFloat), loss_full, 2e-2, "loss");
  const auto ours = half.hf_state_dict(), theirs = full.hf_state_dict();
  int adapters = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    if (!models::CausalLM::is_lora_name(ours[i].first)) continue;
    ++adapters;
    ASSERT_TRUE(ours[i].second.grad().defined()) << ours[i].first;
    EXPECT_EQ(ours[i].second.grad().scalar_type(), at::kFloat) << ours[i].first;
    EXPECT_TENSOR_NEAR(ours[i].second.grad(), theirs[i].second.grad(), 0.3,
                       "gradient of " << ours[i].first);
  }
  EXPECT_EQ(adapters, 2 * 7 * 3);
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

}  // namespace
}  // namespace roundpipe::testing

namespace roundpipe::testing {
namespace {

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

// roundpipe-train's loop end to end on simulated devices: the built-in task
// is really learnt; resuming from a checkpoint continues exactly; datasets;
// packed rows keep documents apart and give the padded batch's loss.
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

TEST(Trainer, LearnsTheReverseTask) {
  auto o = tiny("learn");
  o.steps = 400;
  o.lr = 1e-3;
  o.sync_step = true;
  const auto s = train::run_training(o);
  // Uniform guessing over 10 letters costs ~1.8 nats per answer token; only
  // a model that learnt to reverse gets far below it and answers held-out
  // words exactly.
  EXPECT_LT(s.accuracy_before, 0.05);
  EXPECT_LT(s.final_loss, 0.6);
  EXPECT_GT(s.accuracy_after, 0.35);
  // The saved checkpoint loads and holds the trained weights.
  auto model = models::CausalLM::from_pretrained(o.output);
  EXPECT_EQ(model.config().model_type, "qwen3");
}

// With float32 moments and with 8-bit ones (--optim adamw8bit). A resumed
// run's automatic plan may sum a gradient in another order (a few ulps):
// float32 state carries that on as such, 8-bit state where a moment lies
// that close to the midpoint of two codes stores the other one, and that
// element's later updates differ by up to about lr each (bias-corrected
// m / sqrt(v) is about 1). Such elements are rare.
TEST(Trainer, ResumingContinuesAsIfNeverStopped) {
  for (const std::string optim : {"adamw", "adamw8bit"}) {
    SCOPED_TRACE(optim);
    auto through = tiny("through_" + optim);
    through.steps = 20;
    through.optim = optim;
    through.checkpoint_every = 10;  // saved at step 10, the run goes on
    train::run_training(through);
    auto resumed = tiny("resumed_" + optim);
    resumed.steps = 20;
    resumed.optim = optim;
    resumed.resume = true;
    resumed.checkpoint_dir = through.output + ".ckpt";  // the step-10 checkpoint
    train::run_training(resumed);
    auto a = models::CausalLM::from_pretrained(through.output).hf_state_dict();
    auto b = models::CausalLM::from_pretrained(resumed.output).hf_state_dict();
    ASSERT_EQ(a.size(), b.size());
    int64_t elements = 0, apart = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const auto& [name, want] = a[i];
      const auto& got = b[i].second;
      if (optim == "adamw") {
        EXPECT_TENSOR_NEAR(got, want, 1e-6, name);
        continue;
      }
      EXPECT_TENSOR_ABS_NEAR(got, want, 10 * through.lr, name);  // 10 updates after the resume
      const auto beyond = (got - want).abs() > 1e-6 * want.abs().max();
      apart += beyond.sum().item<int64_t>();
      elements += want.numel();
    }
    EXPECT_LE(apart, elements / 100) << "elements apart by more than float32's rounding";
  }
}

std::vector<std::pair<std::string, at::Tensor>> trained_weights(const std::string& output) {
  return models::CausalLM::from_pretrained(output).hf_state_dict();
}

void expect_same_weights(const std::string& a_dir, const std::string& b_dir, double tol) {
  auto a = trained_weights(a_dir), b = trained_weights(b_dir);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TENSOR_NEAR(b[i].second, a[i].second, tol, a[i].first);
}

// Saving a checkpoint waits for the async step without publishing it, so
// a run that checkpoints every step trains exactly what one that never
// does trains (before, the checkpoint gave the next call fresher weights).
TEST(Trainer, CheckpointingDoesNotChangeAnAsyncRun) {
  auto plain = tiny("plain"), saving = tiny("saving");
  plain.steps = saving.steps = 12;
  saving.checkpoint_every = 1;
  train::run_training(plain);
  train::run_training(saving);
  expect_same_weights(plain.output, saving.output, 1e-6);
}

// SIGINT while training: the step in flight finishes, a training
// checkpoint is written, TrainingInterrupted is thrown; --resume then ends
// where an uninterrupted run ends.
TEST(Trainer, InterruptSavesACheckpointAndResumeMatchesAnUninterruptedRun) {
  auto through = tiny("uninterrupted");
  through.steps = 12;
  train::run_training(through);
  auto stopped = tiny("interrupted");
  stopped.steps = 12;
  stopped.after_step = [](int64_t done) {
    if (done == 5) ::raise(SIGINT);  // delivered to this thread: the handler runs at once
  };
  try {
    train::run_training(stopped);
    FAIL() << "the run was not interrupted";
  } catch (const train::TrainingInterrupted& e) {
    EXPECT_EQ(e.signal, SIGINT);
    EXPECT_HAS(std::string(e.what()), "after step 5 of 12");
    EXPECT_TRUE(fs::exists(stopped.output + ".ckpt/checkpoint.json"));
  }
  EXPECT_FALSE(fs::exists(stopped.output + "/model.safetensors"));
  stopped.after_step = nullptr;
  stopped.resume = true;
  train::run_training(stopped);
  expect_same_weights(through.output, stopped.output, 1e-6);
  // The handler is gone again: SIGINT's disposition is what it was.
  struct sigaction now {};
  ::sigaction(SIGINT, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
}

TEST(Trainer, EveryOptionIsValidatedBeforeTraining) {
  auto expect_rejected = [](auto change, const std::string& option) {
    auto o = tiny("invalid");
    change(o);
    EXPECT_HAS(error_of([&] { train::run_training(o); }), option);
  };
  expect_rejected([](auto& o) { o.batch_size = 0; }, "--batch-size must be at least 1");
  expect_rejected([](auto& o) { o.log_every = 0; }, "--log-every must be at least 1");
  expect_rejected([](auto& o) { o.steps = -3; }, "--steps must be >= 0");
  expect_rejected([](auto& o) { o.microbatches = -2; }, "--microbatches must be >= 0");
  expect_rejected([](auto& o) { o.checkpoint_every = -1; }, "--checkpoint-every must be >= 0");
  expect_rejected([](auto& o) { o.seq_len = -5; }, "--seq-len must be at least 2");
  expect_rejected([](auto& o) { o.epochs = -1; }, "--epochs must be >= 0");
  expect_rejected([](auto& o) { o.lr = -1; }, "--lr must be a positive number");
  expect_rejected([](auto& o) { o.lr = std::nan(""); }, "--lr must be a positive number");
  expect_rejected([](auto& o) { o.optim = "adam8"; }, "--optim: expected adamw");
  expect_rejected([](auto& o) { o.digits = 40; }, "--digits must be between 1 and 9");
  expect_rejected([](auto& o) { o.loss_chunk = 0; }, "--loss-chunk must be at least 1");
  expect_rejected([](auto& o) { o.recompute = "block"; },
                  "--recompute must be stage, layer or layer_from_stage");
  expect_rejected([](auto& o) { o.memory_limit_gib = -2; }, "--memory-limit must be a size in GiB");
  expect_rejected([](auto& o) { o.host_checkpoint_limit_gib = -1; },
                  "--host-checkpoint-limit must be a size in GiB");
  expect_rejected([](auto& o) { o.dtype = "int8"; }, "unknown dtype 'int8'");
  expect_rejected([](auto& o) { o.task = "sorting"; }, "--task must be reverse or addition");
  expect_rejected([](auto& o) { o.devices = "sim:2,jitter_us=-5"; }, "jitter_us");
  expect_rejected([](auto& o) { o.output = ""; }, "must not be empty");
}

// --output: files that are not ours stay; a model already there is
// replaced only with --overwrite; a regular file is refused before
// training; a trailing separator or "." work.
TEST(Trainer, OutputDirectoryKeepsOtherFilesAndNeverLosesAModel) {
  auto o = tiny("outdir");
  o.steps = 2;
  fs::create_directories(o.output);
  std::ofstream(o.output + "/notes.txt") << "mine";
  o.output += "/";
  train::run_training(o);
  EXPECT_TRUE(fs::exists(o.output + "notes.txt"));
  EXPECT_TRUE(fs::exists(o.output + "model.safetensors"));
  EXPECT_HAS(error_of([&] { train::run_training(o); }), "already holds a model");
  o.overwrite = true;
  train::run_training(o);
  EXPECT_TRUE(fs::exists(o.output + "notes.txt"));

  auto file = tiny("outfile");
  std::ofstream(file.output) << "not a directory";
  EXPECT_HAS(error_of([&] { train::run_training(file); }), "exists and is not a directory");
  std::ifstream in(file.output);
  std::string kept;
  std::getline(in, kept);
  EXPECT_EQ(kept, "not a directory");

  auto here = tiny("dot");
  here.steps = 2;
  fs::create_directories(here.output);
  const auto cwd = fs::current_path();
  fs::current_path(here.output);
  here.output = ".";  // the checkpoint goes beside it, as <directory>.ckpt
  const auto error = error_of([&] { train::run_training(here); });
  fs::current_path(cwd);
  EXPECT_EQ(error, "(no error)");
  EXPECT_TRUE(fs::exists(tiny("dot").output + "/model.safetensors"));
}

TEST(Trainer, AnEarlierRunsCheckpointNeedsResumeOrOverwrite) {
  auto o = tiny("earlier");
  o.steps = 4;
  o.checkpoint_every = 2;
  train::run_training(o);
  o.overwrite = true;  // the model in --output may be replaced; the checkpoint is the question
  auto again = tiny("earlier_again");
  again.checkpoint_dir = o.output + ".ckpt";
  EXPECT_HAS(error_of([&] { train::run_training(again); }),
             "holds a training checkpoint (step 2) of an earlier run: pass --resume");
  EXPECT_FALSE(fs::exists(again.output)) << "a failed start leaves nothing";
  // Something that is not a checkpoint of ours is never written over.
  auto foreign = tiny("foreign");
  foreign.checkpoint_dir = foreign.output + ".mine";
  fs::create_directories(foreign.checkpoint_dir);
  std::ofstream(foreign.checkpoint_dir + "/data.bin") << "x";
  foreign.overwrite = true;
  EXPECT_HAS(error_of([&] { train::run_training(foreign); }),
             "is not a RoundPipe training checkpoint");
  // Resuming past --steps, or from a damaged step, says so.
  auto past = o;
  past.resume = true;
  past.steps = 1;
  past.allow_resume_change = "steps";  // (Note [Resume settings])
  EXPECT_HAS(error_of([&] { train::run_training(past); }), "nothing is left to train");
  auto meta = o.output + ".ckpt/checkpoint.json";
  std::stringstream text;
  text << std::ifstream(meta).rdbuf();
  auto damaged = std::regex_replace(text.str(), std::regex("\"step\": \"2\""), "\"step\": \"x2\"");
  ASSERT_NE(damaged, text.str());
  std::ofstream(meta) << damaged;
  past.steps = 8;
  EXPECT_HAS(error_of([&] { train::run_training(past); }), "the step must be a whole number");
}

// Temporaries of killed runs (a checkpoint write, a model save) are removed
// at the next start; those of running processes are not.
TEST(Trainer, LeftoversOfKilledRunsAreRemovedAtTheNextStart) {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);  // a process id that no longer runs
  auto o = tiny("leftovers");
  o.steps = 2;
  const std::string dead = std::to_string(child), alive = std::to_string(::getppid());
  fs::create_directories(o.output + ".ckpt.tmp-" + dead);
  fs::create_directories(o.output + "/.roundpipe-tmp-" + dead);
  fs::create_directories(o.output + ".ckpt.tmp-" + alive);
  train::run_training(o);
  EXPECT_FALSE(fs::exists(o.output + ".ckpt.tmp-" + dead));
  EXPECT_FALSE(fs::exists(o.output + "/.roundpipe-tmp-" + dead));
  EXPECT_TRUE(fs::exists(o.output + ".ckpt.tmp-" + alive));
  fs::remove_all(o.output + ".ckpt.tmp-" + alive);
}

// A run that diverges stops at the first non-finite loss or weights with
// an error; no checkpoint or model of NaN weights is written.
TEST(Trainer, DivergenceStopsAndKeepsTheLastGoodCheckpoint) {
  auto o = tiny("diverge");
  o.steps = 30;
  o.lr = 1e30;
  o.checkpoint_every = 1;
  const auto error = error_of([&] { train::run_training(o); });
  EXPECT_HAS(error, "training diverged");
  EXPECT_FALSE(fs::exists(o.output + "/model.safetensors"));
  // The metrics of the steps before it are written, norms and all.
  std::ifstream metrics(o.output + "/metrics.jsonl");
  int64_t lines = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto entry = nlohmann::json::parse(line);
    EXPECT_EQ(entry["step"].get<int64_t>(), ++lines);
    EXPECT_TRUE(entry.contains("grad_norm")) << line;
  }
  EXPECT_GE(lines, 1) << error;
  if (fs::exists(o.output + ".ckpt")) {  // the last good one holds finite masters
    const auto masters = safetensors::load_file(o.output + ".ckpt/master.safetensors");
    for (const auto& [name, t] : masters.tensors)
      EXPECT_TRUE(at::isfinite(t).all().item<bool>()) << name;
  }
}

TEST(TrainData, JsonlFormatsAndErrors) {
  const auto path = temp("data.jsonl");
  {
    std::ofstream out(path);
    out << R"({"input_ids": [1, 5, 6, 2]})"
        << "\n\n"
        << R"({"input_ids": [1, 5, 6], "labels": [-100, 5, 6]})"
        << "\n"
        << R"({"text": "hi"})"
        << "\n"
        << R"({"prompt": "a", "completion": "b"})"
        << "\n";
  }
  auto examples = train::load_jsonl(path, 16, 300);
  ASSERT_EQ(examples.size(), 4u);
  EXPECT_EQ(examples[1].labels[0], -100);
  EXPECT_EQ(train::ByteTokenizer::decode(examples[2].input_ids), "hi");
  EXPECT_EQ(examples[3].labels[1], -100);  // the prompt is not trained on
  EXPECT_EQ(examples[3].labels[2], train::ByteTokenizer::encode("b")[0]);
  auto error_of = [&](const std::string& line, int64_t vocab) {
    std::ofstream(path) << line << "\n";
    try {
      train::load_jsonl(path, 16, vocab);
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  EXPECT_NE(error_of("{oops", 300).find(":1: not valid JSON"), std::string::npos);
  EXPECT_NE(error_of(R"({"input_ids": [1, 999]})", 300).find("outside the vocab"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"text": "x"})", 100).find("byte-level tokenizer"), std::string::npos);
  EXPECT_NE(error_of(R"({"other": 1})", 300).find("needs input_ids, text"), std::string::npos);
  // Token ids are whole numbers (3.7 is not read as 3); labels are -100 or
  // in the vocab, checked at load rather than at the step that reaches them.
  EXPECT_NE(error_of(R"({"input_ids": [1, 3.7, 5]})", 300).find("must hold whole numbers"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"input_ids": [1, 3], "labels": [-100, 300]})", 300)
                .find("label 300 is outside the vocab"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"input_ids": "1 2 3"})", 300).find("must be a list of token ids"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"text": 5})", 300).find("text must be a string"), std::string::npos);
  EXPECT_NE(error_of(R"([1, 2])", 300).find("must be a JSON object"), std::string::npos);
}

// Examples of 2..9 tokens with some labels ignored, distinct token ids.
std::vector<train::Example> ragged_examples(int count) {
  std::vector<train::Example> out;
  int64_t id = 3;
  for (int i = 0; i < count; ++i) {
    train::Example ex;
    for (int t = 0; t < 2 + (i * 5) % 8; ++t, ++id) {
      ex.input_ids.push_back(id % 250 + 3);
      ex.labels.push_back(t == 1 ? -100 : id % 250 + 3);  // a prompt token
    }
    out.push_back(ex);
  }
  return out;
}

TEST(TrainData, PackingKeepsDocumentsApart) {
  const auto examples = ragged_examples(11);
  std::vector<int64_t> order(examples.size());
  std::iota(order.begin(), order.end(), 0);
  const int64_t max_length = 12, min_rows = 3;
  const auto batch = train::pack(examples, order, 0, 11, max_length, min_rows);
  EXPECT_FALSE(batch.attention_mask.defined());
  const int64_t rows = batch.input_ids.size(0), length = batch.input_ids.size(1);
  EXPECT_GE(rows, min_rows);
  EXPECT_LE(length, max_length);
  const auto ids = batch.input_ids.accessor<int64_t, 2>();
  const auto labels = batch.labels.accessor<int64_t, 2>();
  const auto positions = batch.position_ids.accessor<int64_t, 2>();
  // Walk each row's documents (a position 0 starts one): every example is
  // found exactly once, whole, with its own labels except the first, which
  // is -100 so that nothing is predicted across a document boundary.
  std::vector<int> found(examples.size(), 0);
  int64_t tokens = 0, loss_tokens = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < length;) {
      ASSERT_EQ(positions[r][t], 0) << "row " << r << " column " << t;
      int64_t end = t + 1;
      while (end < length && positions[r][end] == positions[r][end - 1] + 1) ++end;
      EXPECT_EQ(labels[r][t], -100) << "the first label of a document";
      if (ids[r][t] == train::ByteTokenizer::kPad) {  // the tail: padding only
        EXPECT_EQ(end, length);
        for (int64_t u = t; u < end; ++u) {
          EXPECT_EQ(ids[r][u], train::ByteTokenizer::kPad);
          EXPECT_EQ(labels[r][u], -100);
        }
      } else {
        size_t match = 0;
        while (match < examples.size() && examples[match].input_ids[0] != ids[r][t]) ++match;
        ASSERT_LT(match, examples.size()) << "row " << r << " column " << t;
        const auto& ex = examples[match];
        ASSERT_EQ(static_cast<int64_t>(ex.input_ids.size()), end - t);
        for (int64_t u = t + 1; u < end; ++u) {
          EXPECT_EQ(ids[r][u], ex.input_ids[u - t]);
          EXPECT_EQ(labels[r][u], ex.labels[u - t]);
          loss_tokens += ex.labels[u - t] != -100;
        }
        ++found[match];
        tokens += end - t;
      }
      t = end;
    }
  }
  EXPECT_EQ(found, std::vector<int>(examples.size(), 1));
  EXPECT_EQ(batch.tokens, tokens);
  EXPECT_EQ(batch.loss_tokens, loss_tokens);
  // The padded batch of the same examples counts the same labels.
  EXPECT_EQ(train::collate(examples, order, 0, 11).loss_tokens, loss_tokens);
  // Fewer examples than microbatches cannot fill a row each.
  try {
    train::pack(examples, order, 0, 2, max_length, 3);
    ADD_FAILURE() << "packed 2 examples into 3 rows";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--batch-size"), std::string::npos) << e.what();
  }
}

// The model computes each packed document as it would alone: the packed
// batch's loss and gradients are the padded batch's, through RoundPipe's
// microbatches, both token-weighted over the whole batch.
TEST(TrainData, PackedRowsGiveThePaddedBatchsLossAndGradients) {
  const auto config = models::CausalLMConfig::from_json_file(std::string(ROUNDPIPE_SOURCE_DIR) +
                                                             "/configs/qwen3-tiny/config.json");
  const auto examples = ragged_examples(9);
  std::vector<int64_t> order(examples.size());
  std::iota(order.begin(), order.end(), 0);
  auto run = [&](const train::Batch& batch) {
    torch::manual_seed(5);
    models::CausalLM model(config);
    RoundPipe pipe(model.sequential(), RoundPipeOptions().set_devices("sim:2"));
    models::CausalLMInput in;
    in.input_ids = batch.input_ids;
    in.attention_mask = batch.attention_mask;
    in.position_ids = batch.position_ids;
    in.labels = batch.labels;
    in.num_items_in_batch = static_cast<double>(batch.loss_tokens);
    auto result = pipe.forward_backward(
        in.to_ivalue(), c10::IValue(),
        [](const c10::IValue& out, const c10::IValue&) { return out.toTensor(); }, false,
        RunConfig().set_num_microbatch(3));
    pipe.synchronize();
    std::vector<at::Tensor> grads;
    for (const auto& p : model.sequential()->parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(result.loss, grads);
  };
  const auto [padded_loss, padded] = run(train::collate(examples, order, 0, 9));
  const auto [packed_loss, packed] = run(train::pack(examples, order, 0, 9, 16, 3));
  // fp32, the same sums in another order (rows and microbatches differ).
  EXPECT_TENSOR_NEAR(packed_loss, padded_loss, 1e-5, "loss");
  ASSERT_EQ(packed.size(), padded.size());
  for (size_t i = 0; i < packed.size(); ++i)
    EXPECT_TENSOR_NEAR(packed[i], padded[i], 1e-4, "gradient " << i);
}

// roundpipe-train with and without packing: the same examples per step and
// a token-weighted loss over the microbatches, so the same first loss.
TEST(Trainer, PackingDoesNotChangeTheLoss) {
  auto run = [&](bool packing) {
    auto o = tiny(packing ? "packed" : "padded");
    o.steps = 1;
    o.batch_size = 16;
    o.log_every = 1;
    o.eval_examples = 0;
    o.packing = packing;
    return train::run_training(o).first_loss;
  };
  const double packed = run(true), padded = run(false);
  EXPECT_NEAR(packed, padded, 1e-5 * std::abs(padded));
}

TEST(TrainData, TasksAreDeterministicAndCorrect) {
  auto a = train::reversal_task(5, 4, 7), b = train::reversal_task(5, 4, 7);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].input_ids, b[i].input_ids);
  const auto text = train::ByteTokenizer::decode(a[0].input_ids);  // "wxyz|zyxw"
  ASSERT_EQ(text.size(), 9u);
  EXPECT_EQ(text.substr(5), std::string(text.rbegin() + 5, text.rend()));
  const auto sum = train::ByteTokenizer::decode(train::addition_task(1, 2, 3)[0].input_ids);
  const int x = std::stoi(sum.substr(0, 2)), y = std::stoi(sum.substr(3, 2));
  EXPECT_EQ(std::stoi(sum.substr(6, 3)), x + y) << sum;
}

}  // namespace
}  // namespace roundpipe::testing

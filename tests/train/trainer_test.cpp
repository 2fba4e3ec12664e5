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

TEST(Trainer, ResumingContinuesExactly) {
  auto through = tiny("through");
  through.steps = 20;
  through.checkpoint_every = 10;  // saved at step 10, the run goes on
  train::run_training(through);
  auto resumed = tiny("resumed");
  resumed.steps = 20;
  resumed.resume = true;
  resumed.checkpoint_dir = through.output + ".ckpt";  // the step-10 checkpoint
  train::run_training(resumed);
  auto a = models::CausalLM::from_pretrained(through.output).hf_state_dict();
  auto b = models::CausalLM::from_pretrained(resumed.output).hf_state_dict();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TENSOR_NEAR(b[i].second, a[i].second, 1e-6, a[i].first);
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
  expect_rejected([](auto& o) { o.digits = 40; }, "--digits must be between 1 and 9");
  expect_rejected([](auto& o) { o.loss_chunk = 0; }, "--loss-chunk must be at least 1");
  expect_rejected([](auto& o) { o.recompute = "block"; }, "--recompute must be stage or layer");
  expect_rejected([](auto& o) { o.memory_limit_gib = -2; }, "--memory-limit must be a size in GiB");
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

namespace roundpipe::testing {
namespace {

// Runs `code` with the test's Python (transformers, peft: scripts/setup.sh)
// and `args`, then the path of a file it writes its answer to; returns it.
std::string run_python(const std::string& tag, const std::string& code, const std::string& args) {
  const std::string script = temp(tag + ".py"), out = temp(tag + ".txt");
  std::ofstream(script) << code;
  const std::string cmd = std::string(ROUNDPIPE_PYTHON) + " " + script + " " + args + " " + out +
                          " > " + out + ".log 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "see " << out << ".log";
  std::ifstream file(out);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

// The loss of `ids` (labels = ids) from transformers + peft: the base
// checkpoint with the adapter in `adapter` ("" for none), by the test's
// Python (peft and transformers, scripts/setup.sh).
double python_loss(const std::string& base, const std::string& adapter, const std::string& tag) {
  const auto printed = run_python(tag,
                                  "import sys, torch, transformers\n"
                                  "model = transformers.AutoModelForCausalLM.from_pretrained("
                                  "sys.argv[1]).float()\n"
                                  "if sys.argv[2]:\n"
                                  "    import peft\n"
                                  "    model = peft.PeftModel.from_pretrained(model, sys.argv[2])\n"
                                  "ids = (torch.arange(24).reshape(2, 12) * 7 + 3) % 259\n"
                                  "with torch.no_grad():\n"
                                  "    print(float(model(input_ids=ids, labels=ids).loss), "
                                  "file=open(sys.argv[-1], 'w'))\n",
                                  base + " '" + adapter + "'");
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

// --lr-schedule with --warmup-ratio: the learning rate of every update is
// transformers' get_*_schedule_with_warmup's (the warmup rounded up, as its
// Trainer does: 10 steps x 0.25 -> 3).
TEST(Trainer, LearningRateSchedulesAreTransformers) {
  for (const std::string kind : {"constant", "linear", "cosine"}) {
    SCOPED_TRACE(kind);
    auto o = tiny("lr_" + kind);
    o.steps = 10;
    o.train_examples = 640;
    o.lr = 1e-3;
    o.lr_schedule = kind;
    o.warmup_ratio = 0.25;
    const auto summary = train::run_training(o);
    std::istringstream expected(
        run_python("lr_" + kind,
                   "import sys, torch, transformers\n"
                   "kind, lr, warmup, total = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), "
                   "int(sys.argv[4])\n"
                   "opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)\n"
                   "make = getattr(transformers, f'get_{kind}_schedule_with_warmup')\n"
                   "sched = make(opt, warmup) if kind == 'constant' else make(opt, warmup, total)\n"
                   "rates = []\n"
                   "for _ in range(total):\n"
                   "    rates.append(opt.param_groups[0]['lr'])\n"
                   "    opt.step()\n"
                   "    sched.step()\n"
                   "print(' '.join(map(repr, rates)), file=open(sys.argv[-1], 'w'))\n",
                   kind + " 1e-3 3 10"));
    ASSERT_EQ(summary.learning_rates.size(), 10u);
    for (size_t i = 0; i < summary.learning_rates.size(); ++i) {
      double theirs = NAN;
      expected >> theirs;
      EXPECT_NEAR(summary.learning_rates[i], theirs, 1e-15) << "update " << i;
    }
  }
  auto both = tiny("lr_both");
  both.warmup_steps = 2;
  both.warmup_ratio = 0.1;
  EXPECT_THROW(train::validate(both), c10::Error);
  auto unknown = tiny("lr_unknown");
  unknown.lr_schedule = "step";
  EXPECT_THROW(train::validate(unknown), c10::Error);
}

// metrics.jsonl in the output folder: a line per step with its loss, learning
// rate, tokens, throughput and memory; a resumed run keeps the lines up to
// its checkpoint and writes the rest again, once.
TEST(Trainer, MetricsFileHasALinePerStep) {
  auto o = tiny("metrics");
  o.steps = 6;
  o.train_examples = 640;
  o.lr_schedule = "linear";
  o.checkpoint_every = 3;
  o.overwrite = true;
  const auto summary = train::run_training(o);
  auto lines = [&] {  // the steps' lines (the last line is the final evaluation)
    std::vector<nlohmann::json> out;
    std::ifstream file(o.output + "/metrics.jsonl");
    for (std::string line; std::getline(file, line);) {
      auto entry = nlohmann::json::parse(line);
      if (entry.contains("loss")) out.push_back(entry);
    }
    return out;
  };
  auto first = lines();
  ASSERT_EQ(first.size(), 6u);
  int64_t tokens = 0;
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(first[i]["step"].get<int64_t>(), static_cast<int64_t>(i) + 1);
    EXPECT_DOUBLE_EQ(first[i]["lr"].get<double>(), summary.learning_rates[i]);
    const double loss = first[i]["loss"].get<double>();
    EXPECT_TRUE(std::isfinite(loss) && loss > 0) << loss;
    EXPECT_GT(first[i]["tokens_per_second"].get<double>(), 0);
    EXPECT_GT(first[i]["host_resident_bytes"].get<int64_t>(), 0);
    tokens += first[i]["tokens"].get<int64_t>();
  }
  EXPECT_EQ(tokens, summary.tokens);
  EXPECT_LT(first.back()["loss"].get<double>(), first.front()["loss"].get<double>());
  // Resumed from the step-3 checkpoint: steps 1-3 kept, 4-6 written again.
  auto resumed = o;
  resumed.resume = true;
  resumed.overwrite = false;
  train::run_training(resumed);
  auto second = lines();
  ASSERT_EQ(second.size(), 6u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(second[i], first[i]) << "step " << i + 1;
  for (size_t i = 3; i < 6; ++i) {
    EXPECT_EQ(second[i]["step"].get<int64_t>(), static_cast<int64_t>(i) + 1);
    EXPECT_NEAR(second[i]["loss"].get<double>(), first[i]["loss"].get<double>(),
                1e-4 * first[i]["loss"].get<double>());
  }
}

// --grad-accum 2 with --batch-size 8 trains as --batch-size 16: each step's
// loss (the mean over the step's labelled tokens) is the same. The step's
// examples are packed into other rows, so the same sums run in another
// order (fp32: ~1e-6 relative), which three Adam steps carry into the loss
// well below 1e-4.
TEST(Trainer, GradientAccumulationEqualsOneBigBatch) {
  auto run = [&](const std::string& name, int64_t batch, int64_t accumulate) {
    auto o = tiny(name);
    o.steps = 4;
    o.train_examples = 640;
    o.batch_size = batch;
    o.grad_accum = accumulate;
    o.sync_step = true;
    o.overwrite = true;
    train::run_training(o);
    std::vector<double> losses;
    std::ifstream file(o.output + "/metrics.jsonl");
    for (std::string line; std::getline(file, line);) {
      const auto entry = nlohmann::json::parse(line);
      if (entry.contains("loss"))
        losses.push_back(entry["loss"].get<double>());  // (not evaluations)
    }
    return losses;
  };
  const auto big = run("accum_big", 16, 1), accumulated = run("accum_2x8", 8, 2);
  ASSERT_EQ(big.size(), 4u);
  ASSERT_EQ(accumulated.size(), 4u);
  for (size_t i = 0; i < big.size(); ++i)
    EXPECT_NEAR(accumulated[i], big[i], 1e-4 * big[i]) << "step " << i + 1;
  EXPECT_LT(big.back(), big.front()) << "training changed nothing";
  auto zero = tiny("accum_zero");
  zero.grad_accum = 0;
  EXPECT_THROW(train::validate(zero), c10::Error);
}

// --eval-data: the held-out loss at the end is transformers' on the saved
// model (the mean over every labelled token of the examples, padded into
// batches here), and --eval-every adds it to the metrics lines.
TEST(Trainer, EvaluationLossIsTransformers) {
  const std::string data = temp("eval_data.jsonl");
  {
    std::ofstream file(data);
    for (int e = 0; e < 5; ++e) {
      std::string ids;
      for (int t = 0; t < 6 + 3 * e; ++t)
        ids += (t ? "," : "") + std::to_string((e * 31 + t * 7) % 256 + 3);
      file << "{\"input_ids\": [" << ids << "]}\n";
    }
  }
  auto o = tiny("eval");
  o.steps = 4;
  o.train_examples = 640;
  o.batch_size = 4;  // eval batches of 4 and 1 examples: padding, and fewer rows than microbatches
  o.eval_data = data;
  o.eval_every = 2;
  o.overwrite = true;
  const auto summary = train::run_training(o);
  std::istringstream theirs(run_python(
      "eval_loss",
      "import sys, json, torch, transformers\n"
      "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).float().eval()\n"
      "total = count = 0\n"
      "for line in open(sys.argv[2]):\n"
      "    ids = torch.tensor([json.loads(line)['input_ids']])\n"
      "    with torch.no_grad():\n"
      "        loss = model(input_ids=ids, labels=ids).loss\n"
      "    total += float(loss) * (ids.shape[1] - 1)\n"
      "    count += ids.shape[1] - 1\n"
      "print(repr(total / count), file=open(sys.argv[-1], 'w'))\n",
      o.output + " " + data));
  double expected = NAN;
  theirs >> expected;
  EXPECT_NEAR(summary.eval_loss, expected, 1e-5 * expected);
  int evaluated = 0;
  std::ifstream file(o.output + "/metrics.jsonl");
  for (std::string line; std::getline(file, line);) {
    const auto entry = nlohmann::json::parse(line);
    if (!entry.contains("eval_loss")) continue;
    ++evaluated;
    EXPECT_NEAR(entry["eval_perplexity"].get<double>(), std::exp(entry["eval_loss"].get<double>()),
                1e-9 * entry["eval_perplexity"].get<double>());
  }
  EXPECT_EQ(evaluated, 2) << "after step 2 and at the end";
}

// Weight decay applies to the matrices, not to norms' weights nor biases.
TEST(Trainer, WeightDecaySkipsNormsAndBiases) {
  EXPECT_TRUE(train::weight_decay_applies("3.self_attn.q_proj.weight"));
  EXPECT_TRUE(train::weight_decay_applies("0.embed_tokens.weight"));
  EXPECT_FALSE(train::weight_decay_applies("3.input_layernorm.weight"));
  EXPECT_FALSE(train::weight_decay_applies("3.self_attn.q_norm.weight"));
  EXPECT_FALSE(train::weight_decay_applies("5.norm.weight"));
  EXPECT_FALSE(train::weight_decay_applies("3.self_attn.q_proj.bias"));
}

}  // namespace
}  // namespace roundpipe::testing

namespace roundpipe::testing {
namespace {

// A token file written by roundpipe.prepare's writer (python/roundpipe/
// token_file.py, run by itself): the C++ loader reads the same examples and
// labels, cuts them to max_tokens, and agrees on the fingerprint.
TEST(TokenFile, ReadsWhatPythonWrote) {
  const std::string path = temp("tokens.rpt");
  const auto printed = run_python(
      "token_file",
      "import sys, json\n"
      "sys.path.insert(0, sys.argv[1] + '/python/roundpipe')\n"
      "from token_file import Example, write_token_file, fnv1a64\n"
      "ex = [Example([5, 6, 7, 8], [0, 0, 1, 1]), Example([9, 10], [1, 1]),\n"
      "      Example(list(range(3, 40)), [i % 2 for i in range(37)])]\n"
      "write_token_file(sys.argv[2], ex, {'tokenizer': 'test', 'tokenizer_fingerprint': '',\n"
      "                                   'chat_template_fingerprint': ''})\n"
      "header = write_token_file(sys.argv[2] + '.broken', ex, {'tokenizer': 'test'})\n"
      "with open(sys.argv[2] + '.broken', 'r+b') as f:\n"
      "    f.seek(header['sections']['offsets'][0] + 8)\n"
      "    f.write((-5).to_bytes(8, 'little', signed=True))  # offsets decrease\n"
      "json.dump({'labels': [e.labels for e in ex], 'fnv': fnv1a64('héllo'.encode())},\n"
      "          open(sys.argv[-1], 'w'))\n",
      std::string(ROUNDPIPE_SOURCE_DIR) + " " + path);
  const auto expected = nlohmann::json::parse(printed);
  ASSERT_TRUE(train::TokenFile::is_token_file(path));
  train::TokenFile file(path, /*max_tokens=*/16);
  ASSERT_EQ(file.size(), 3);
  EXPECT_EQ(file.num_tokens(), 4 + 2 + 37);
  EXPECT_EQ(file.tokenizer(), "test");
  for (int64_t i = 0; i < file.size(); ++i) {
    auto labels = expected["labels"][i].get<std::vector<int64_t>>();
    if (labels.size() > 16) labels.resize(16);
    const auto ex = file.at(i);
    EXPECT_EQ(ex.labels, labels) << "example " << i;
    EXPECT_EQ(ex.input_ids.size(), labels.size());
  }
  EXPECT_EQ(file.at(0).input_ids, (std::vector<int64_t>{5, 6, 7, 8}));
  EXPECT_EQ(train::fnv1a64_hex("h\xc3\xa9llo"), expected["fnv"].get<std::string>());
  // Ids beyond the model's vocabulary, and a file that is not one.
  EXPECT_THROW(file.check_model(/*vocab_size=*/30, ""), c10::Error);
  EXPECT_NO_THROW(file.check_model(/*vocab_size=*/40, ""));
  // Damaged files are errors naming the fix, never reads outside the file.
  const std::string bad = temp("bad.rpt");
  { std::ofstream(bad) << "RPTOKEN1 and then nothing sensible"; }
  for (const auto& damaged : {bad, path + ".broken"}) {
    try {
      train::TokenFile broken(damaged, 16);
      ADD_FAILURE() << "no error for " << damaged;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("roundpipe.prepare"), std::string::npos) << e.what();
    }
  }
}

// A token file names the tokenizer (tokenizer.json) and chat template it
// was made with; a model directory holding other ones is refused, naming
// the fix. (roundpipe.prepare end to end with roundpipe-train: Python tests.)
TEST(TokenFile, RefusesAModelWithAnotherTokenizerOrChatTemplate) {
  const std::string dir = temp("tokenizer_dir");
  fs::remove_all(dir);
  fs::create_directories(dir);
  { std::ofstream(dir + "/tokenizer.json") << "{\"model\": \"ours\"}"; }
  { std::ofstream(dir + "/tokenizer_config.json") << "{}"; }
  { std::ofstream(dir + "/chat_template.jinja") << "{{ messages }}"; }
  const auto write = [&](const std::string& tokenizer_text, const std::string& template_text) {
    const std::string path = temp("fingerprinted.rpt");
    run_python("fingerprinted",
               "import sys\n"
               "sys.path.insert(0, sys.argv[1] + '/python/roundpipe')\n"
               "from token_file import Example, write_token_file, fnv1a64\n"
               "write_token_file(sys.argv[2], [Example([3, 4], [1, 1])], {'tokenizer': 'x',\n"
               "    'tokenizer_fingerprint': fnv1a64(sys.argv[3].encode()),\n"
               "    'chat_template_fingerprint': fnv1a64(sys.argv[4].encode())})\n"
               "open(sys.argv[-1], 'w').write('ok')\n",
               std::string(ROUNDPIPE_SOURCE_DIR) + " " + path + " '" + tokenizer_text + "' '" +
                   template_text + "'");
    return path;
  };
  const auto error_of = [&](const std::string& path) {
    try {
      train::TokenFile(path, 16).check_model(100, dir);
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error_of(write("{\"model\": \"ours\"}", "{{ messages }}")), "");
  EXPECT_NE(
      error_of(write("{\"model\": \"theirs\"}", "{{ messages }}")).find("another tokenizer.json"),
      std::string::npos);
  EXPECT_NE(error_of(write("{\"model\": \"ours\"}", "{{ other }}")).find("chat template"),
            std::string::npos);
}

}  // namespace
}  // namespace roundpipe::testing

namespace roundpipe::testing {
namespace {

// Every step's global gradient norm is measured and written to the metrics
// (clip_grad_norm_'s arithmetic is tested in FusedStepTest); a limit under
// the norms clips (another trajectory), one far above changes nothing.
TEST(Trainer, GradientNormsAreReportedAndClipped) {
  // Returns the summary and each step's loss from the metrics file.
  auto run = [&](const std::string& name, double max_norm) {
    auto o = tiny(name);
    o.steps = 8;
    o.train_examples = 640;
    o.batch_size = 16;
    o.max_grad_norm = max_norm;
    o.lr = 2e-3;
    o.sync_step = true;
    o.overwrite = true;
    const auto summary = train::run_training(o);
    std::vector<double> losses, written_norms;
    std::ifstream file(o.output + "/metrics.jsonl");
    for (std::string line; std::getline(file, line);) {
      const auto entry = nlohmann::json::parse(line);
      if (!entry.contains("loss")) continue;
      losses.push_back(entry["loss"].get<double>());
      written_norms.push_back(entry["grad_norm"].get<double>());
    }
    EXPECT_EQ(written_norms, summary.grad_norms) << name;
    return std::make_pair(summary, losses);
  };
  const auto [measured, losses] = run("clip_off", 0);
  ASSERT_EQ(measured.grad_norms.size(), 8u);
  for (double n : measured.grad_norms) EXPECT_TRUE(std::isfinite(n) && n > 0) << n;
  const double smallest = *std::min_element(measured.grad_norms.begin(), measured.grad_norms.end());
  // (Microbatch gradients may add up in another order from run to run:
  // float32 rounding, ~1e-7 relative.)
  const auto [far_above, far_above_losses] = run("clip_far_above", 1e6);
  for (size_t k = 0; k < 8; ++k) {
    EXPECT_NEAR(far_above.grad_norms[k], measured.grad_norms[k], 1e-5 * measured.grad_norms[k]);
    EXPECT_NEAR(far_above_losses[k], losses[k], 1e-5 * losses[k]);
  }
  // Clipping every step to a tenth of the smallest norm: the first step's
  // loss is of the same weights; Adam's first update hardly depends on the
  // gradient's scale (through eps only), later ones weigh the clipped
  // gradients otherwise, and the losses part.
  const auto [clipped, clipped_losses] = run("clip_binding", smallest / 10);
  EXPECT_NEAR(clipped_losses[0], losses[0], 1e-5 * losses[0]);
  double parted = 0;
  for (size_t k = 2; k < 8; ++k)
    parted = std::max(parted, std::abs(clipped_losses[k] - losses[k]) / losses[k]);
  EXPECT_GT(parted, 1e-3) << "clipping changed nothing";
  auto bad = tiny("clip_bad");
  bad.max_grad_norm = -1;
  EXPECT_THROW(train::validate(bad), c10::Error);
}

// --eval-fraction holds out part of --data: evaluated at the end, never
// trained on (the training examples are the rest).
TEST(Trainer, EvalFractionHoldsOutPartOfTheData) {
  const std::string data = temp("fraction.jsonl");
  {
    std::ofstream file(data);
    for (int e = 0; e < 40; ++e) file << "{\"text\": \"example number " << e << "\"}\n";
  }
  auto o = tiny("fraction");
  o.data = data;
  o.steps = 2;
  o.batch_size = 8;
  o.eval_fraction = 0.25;
  o.overwrite = true;
  const auto summary = train::run_training(o);
  EXPECT_GT(summary.eval_loss, 0);
  auto both = o;
  both.eval_data = data;
  EXPECT_THROW(train::validate(both), c10::Error);
  auto all = o;
  all.eval_fraction = 0.999;
  EXPECT_THROW(train::run_training(all), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing

namespace roundpipe::testing {
namespace {

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

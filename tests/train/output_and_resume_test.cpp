// roundpipe-train under misuse (issue 33): one writer per output (Note [One
// writer per output]), a resume that refuses changed settings (Note [Resume
// settings]), and sizes checked against the data before anything loads.
#include <gtest/gtest.h>
#include <roundpipe/models/causal_lm.h>
#include <signal.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "train/hf_cache.h"
#include "train/output_dir.h"
#include "train/train_test_util.h"

namespace roundpipe::testing {
namespace {

namespace fs = std::filesystem;

std::string file_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(OutputLock, ASecondHolderIsRefusedNamingThePidAndAStaleLockIsTakenOver) {
  const auto dir = temp("lock");
  fs::create_directories(dir);
  const auto file = dir + "/.roundpipe-train.lock";
  {
    train::OutputLock held(file, "--output " + dir);
    EXPECT_EQ(held.taken_over_from(), 0);
    EXPECT_EQ(file_text(file), std::to_string(::getpid()) + "\n");
    // flock(2) locks belong to an open file: a second open is refused even
    // in this process, as another process's would be.
    const auto error = error_of([&] { train::OutputLock(file, "--output " + dir); });
    EXPECT_HAS(error, "PID " + std::to_string(::getpid()));
    EXPECT_HAS(error, "is writing to --output " + dir);
  }
  // Released cleanly: the file is empty, the next holder takes nothing over.
  EXPECT_EQ(file_text(file), "");
  {
    train::OutputLock again(file, "--output " + dir);
    EXPECT_EQ(again.taken_over_from(), 0);
  }
  // A holder killed with -9 leaves its PID in the file but no lock.
  { std::ofstream(file) << "4194303\n"; }
  train::OutputLock taken(file, "--output " + dir);
  EXPECT_EQ(taken.taken_over_from(), 4194303);
}

TEST(Trainer, ASecondRunIntoTheSameOutputIsRefusedAtStart) {
  auto first = tiny("one_output");
  first.steps = 3;
  std::mutex mu;
  std::condition_variable cv;
  bool first_is_training = false, second_tried = false;
  first.after_step = [&](int64_t done) {
    if (done != 1) return;
    std::unique_lock<std::mutex> lock(mu);
    first_is_training = true;
    cv.notify_all();
    cv.wait(lock, [&] { return second_tried; });
  };
  std::thread running([&] { train::run_training(first); });
  std::string error;
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return first_is_training; });
  }
  auto second = tiny("one_output");
  second.steps = 3;
  second.seed = 1;
  error = error_of([&] { train::run_training(second); });
  {
    std::lock_guard<std::mutex> lock(mu);
    second_tried = true;
    cv.notify_all();
  }
  running.join();
  EXPECT_HAS(error, "another roundpipe-train run (PID " + std::to_string(::getpid()) + ")");
  // The first run finished whole: its model and 4 metrics lines (3 steps and
  // the held-out loss at the end), all JSON.
  EXPECT_TRUE(fs::exists(first.output + "/model.safetensors"));
  std::ifstream metrics(first.output + "/metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(metrics, line); ++lines)
    EXPECT_FALSE(nlohmann::json::parse(line, nullptr, false).is_discarded()) << line;
  EXPECT_EQ(lines, 4);
}

TEST(Trainer, ResumeRefusesChangedSettingsAndAllowsTheSafeOnesWhenAsked) {
  auto run = tiny("settings");
  run.steps = 4;
  run.checkpoint_every = 2;
  run.batch_size = 16;
  run.after_step = [](int64_t done) {
    if (done == 2) ::raise(SIGINT);  // saves a checkpoint at step 2 and stops
  };
  EXPECT_HAS(error_of([&] { train::run_training(run); }), "after step 2 of 4");
  run.after_step = nullptr;
  run.resume = true;
  // What decides the examples or the model: refused, named, no override.
  for (auto change : {+[](train::TrainOptions& o) { o.batch_size = 8; },
                      +[](train::TrainOptions& o) { o.seed = 7; },
                      +[](train::TrainOptions& o) { o.task = "reverse"; },
                      +[](train::TrainOptions& o) { o.optim = "adamw_8bit"; }}) {
    auto changed = run;
    change(changed);
    changed.allow_resume_change = "steps,lr";
    const auto error = error_of([&] { train::run_training(changed); });
    EXPECT_HAS(error, "--resume: ");
    EXPECT_HAS(error, "give the same");
  }
  EXPECT_HAS(error_of([&] {
               auto changed = run;
               changed.batch_size = 8;
               train::run_training(changed);
             }),
             "batch-size was 16");
  // The optimizer's rate: refused unless asked for.
  auto faster = run;
  faster.lr = 1e-3;
  EXPECT_HAS(error_of([&] { train::run_training(faster); }), "--allow-resume-change lr");
  EXPECT_HAS(error_of([&] {
               auto bad = run;
               bad.allow_resume_change = "batch-size";
               train::run_training(bad);
             }),
             "not a setting that can change on resume");
  faster.allow_resume_change = "lr";
  const auto summary = train::run_training(faster);
  EXPECT_TRUE(fs::exists(faster.output + "/model.safetensors"));
  (void)summary;
}

TEST(Trainer, SizesAreCheckedAgainstTheDataBeforeAnythingLoadsOrIsWritten) {
  auto huge = tiny("sizes_huge");
  huge.batch_size = 100000000000;
  auto error = error_of([&] { train::run_training(huge); });
  EXPECT_HAS(error, "--batch-size 100000000000 needs 100000000000 examples a step");
  EXPECT_HAS(error, "20000 training examples");
  EXPECT_FALSE(fs::exists(huge.output)) << "a failed start leaves nothing";

  auto accumulated = tiny("sizes_accum");
  accumulated.batch_size = 15000;
  accumulated.grad_accum = 2;
  EXPECT_HAS(error_of([&] { train::run_training(accumulated); }),
             "x --grad-accum 2 needs 30000 examples a step");

  auto many = tiny("sizes_microbatches");
  many.batch_size = 4;
  many.microbatches = 1000;
  error = error_of([&] { train::run_training(many); });
  EXPECT_HAS(error, "--microbatches 1000 is more than the 4 examples of a batch");
  EXPECT_FALSE(fs::exists(many.output));
}

// The saved model carries the tokenizer of the model it was trained from,
// as a transformers Trainer's output does.
TEST(Trainer, TheOutputHoldsTheBaseModelsTokenizer) {
  const auto base = temp("tokenizer_base");
  fs::remove_all(base);
  torch::manual_seed(3);
  models::CausalLM(models::CausalLMConfig::from_json_file(std::string(ROUNDPIPE_SOURCE_DIR) +
                                                          "/configs/qwen3-tiny/config.json"))
      .save_pretrained(base);
  { std::ofstream(base + "/tokenizer.json") << R"({"model": {"type": "BPE"}})"; }
  { std::ofstream(base + "/tokenizer_config.json") << R"({"model_max_length": 64})"; }
  { std::ofstream(base + "/chat_template.jinja") << "{{ messages }}"; }
  auto run = tiny("tokenizer_out");
  run.model = base;
  run.steps = 1;
  train::run_training(run);
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
    EXPECT_EQ(file_text(run.output + "/" + name), file_text(base + "/" + name)) << name;
  EXPECT_FALSE(fs::exists(run.output + "/merges.txt"));  // only what the base has
}

// Note [Model names]: a Hub name resolves to its snapshot in the local
// HuggingFace cache, offline; a missing one fails before anything is
// written, naming the cache and the command that fetches it.
TEST(ModelNames, AHubNameResolvesThroughTheLocalCache) {
  const auto cache = temp("hf_hub_cache");
  const auto snapshot = cache + "/models--Org--Tiny/snapshots/abc123";
  fs::create_directories(snapshot);
  fs::create_directories(cache + "/models--Org--Tiny/refs");
  { std::ofstream(cache + "/models--Org--Tiny/refs/main") << "abc123"; }
  const char* before = std::getenv("HF_HUB_CACHE");
  const std::string saved = before ? before : "";
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  EXPECT_EQ(train::resolve_model_path("Org/Tiny"), snapshot);
  EXPECT_EQ(train::resolve_model_path("Tiny"), snapshot);    // one match for a bare name
  EXPECT_EQ(train::resolve_model_path(snapshot), snapshot);  // a directory is itself
  auto error = error_of([] { train::resolve_model_path("Qwen3-1.7B"); });
  EXPECT_HAS(error, "not in the HuggingFace cache " + cache);
  EXPECT_HAS(error, "hf download ORG/Qwen3-1.7B");
  auto run = tiny("unknown_model");
  run.model = "Qwen/Qwen3-1.7B";
  error = error_of([&] { train::run_training(run); });
  EXPECT_HAS(error, "hf download Qwen/Qwen3-1.7B");
  EXPECT_FALSE(fs::exists(run.output)) << "a failed start leaves nothing";
  if (before) {
    ::setenv("HF_HUB_CACHE", saved.c_str(), 1);
  } else {
    ::unsetenv("HF_HUB_CACHE");
  }
}

}  // namespace
}  // namespace roundpipe::testing

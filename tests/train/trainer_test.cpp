// roundpipe-train's loop end to end on simulated devices: the built-in task
// is really learnt; resuming from a checkpoint continues exactly; datasets.
#include <gtest/gtest.h>
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/train/data.h>
#include <roundpipe/train/trainer.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

namespace fs = std::filesystem;

std::string temp(const std::string& name) {
  return (fs::temp_directory_path() /
          ("roundpipe_train_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

train::TrainOptions tiny(const std::string& name) {
  train::TrainOptions o;
  o.config = std::string(ROUNDPIPE_SOURCE_DIR) + "/configs/qwen3-tiny/config.json";
  o.devices = "sim:2";
  o.output = temp(name);
  o.log_every = 100;
  return o;
}

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

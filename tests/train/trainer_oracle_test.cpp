// roundpipe-train's arithmetic against transformers and PyTorch: learning-
// rate schedules, metrics, gradient accumulation, evaluation loss, weight
// decay, gradient norms and clipping, held-out data, and token files
// written by roundpipe.prepare.
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

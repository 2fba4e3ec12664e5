// metrics.jsonl (MetricsLog): lines in step order as their updates become
// known, evaluations on lines of their own, a resume keeping what came
// before its checkpoint.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <limits>

#include "test_util.h"
#include "train/metrics_log.h"

namespace roundpipe::testing {
namespace {

using train::MetricsLog;

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::string step_line(int64_t step, double loss) {
  return nlohmann::json{{"step", step}, {"loss", loss}, {"tokens", 10 * step}}.dump();
}

TEST(MetricsLog, ALineWaitsForItsUpdateAndTheEndWritesTheRest) {
  const auto path = (process_temp_dir() / "metrics_wait.jsonl").string();
  MetricsLog log(path);
  log.add_step(step_line(1, 2.5));
  log.add_eval(1, 2.0);
  log.add_step(step_line(2, 2.25));
  EXPECT_TRUE(log.write_known({}).empty()) << "no update has run";
  EXPECT_TRUE(read_lines(path).empty());
  // Update 0 (step 1) is known: its line and the evaluation after it go out.
  const auto written = log.write_known({{0.5, 1e-3, std::nullopt}});
  ASSERT_EQ(written.size(), 2u);
  auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["step"], 1);
  EXPECT_EQ(lines[0]["grad_norm"], 0.5);
  EXPECT_EQ(lines[0]["lr"], 1e-3);
  EXPECT_EQ(lines[0]["tokens"], 10);
  EXPECT_FALSE(lines[1].contains("loss"));
  EXPECT_EQ(lines[1]["eval_loss"], 2.0);
  EXPECT_DOUBLE_EQ(lines[1]["eval_perplexity"].get<double>(), std::exp(2.0));
  // A non-finite norm (a step the scaler skipped) is null; a loss given by
  // the update (data parallel's mean) replaces the line's.
  log.add_step(step_line(3, 2.0));
  log.write_known(
      {{0.5, 1e-3, std::nullopt}, {std::numeric_limits<double>::infinity(), std::nullopt, 1.75}});
  lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_TRUE(lines[2]["grad_norm"].is_null());
  EXPECT_EQ(lines[2]["loss"], 1.75);
  EXPECT_FALSE(lines[2].contains("lr"));
  // The end: step 3's update never ran; its line goes out without it.
  log.write_known({{0.5, 1e-3, std::nullopt}, {1.0, std::nullopt, std::nullopt}}, true);
  lines = read_lines(path);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[3]["step"], 3);
  EXPECT_TRUE(lines[3]["grad_norm"].is_null() && lines[3]["lr"].is_null());
}

TEST(MetricsLog, AResumeKeepsTheLinesUpToItsStepAndNoPathWritesNothing) {
  const auto path = (process_temp_dir() / "metrics_resume.jsonl").string();
  {
    MetricsLog first(path);
    for (int64_t s = 1; s <= 4; ++s) first.add_step(step_line(s, 5.0 - s));
    first.write_known({{1, {}, {}}, {2, {}, {}}, {3, {}, {}}, {4, {}, {}}});
  }
  MetricsLog resumed(path, /*first_step=*/2);
  auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1]["grad_norm"], 2);
  resumed.add_step(step_line(3, 9.0));
  resumed.write_known({{7, {}, {}}});  // update 0 of the resumed run is step 3's
  lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[2]["step"], 3);
  EXPECT_EQ(lines[2]["grad_norm"], 7);

  MetricsLog nowhere("");
  nowhere.add_step(step_line(1, 1.0));
  EXPECT_EQ(nowhere.write_known({{1, {}, {}}}).size(), 1u);
  EXPECT_THROW(nowhere.add_step("{\"step\": 1}"), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <roundpipe/execute_plan.h>

namespace roundpipe {
namespace {

std::string error_of(const ExecutePlan& plan, int L, bool fused) {
  try {
    plan.validate(L, fused);
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

TEST(ExecutePlan, AcceptsWellFormedPlans) {
  EXPECT_EQ(error_of(ExecutePlan({{0, 3}, {3, 5}}, {{3, 5}, {1, 3}, {0, 1}}), 5, false), "");
  EXPECT_EQ(error_of(ExecutePlan({{0, 3}}, {{3, 5}, {0, 3}}), 5, true), "");
  EXPECT_EQ(error_of(ExecutePlan::single_stage(4, true), 4, true), "");
  EXPECT_EQ(error_of(ExecutePlan::one_layer_per_stage(4, false), 4, false), "");
}

TEST(ExecutePlan, NamesWhatIsWrong) {
  struct Case {
    ExecutePlan plan;
    bool fused;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {ExecutePlan({{0, 2}, {3, 5}}, {{0, 5}}), false, "without gaps or overlaps"},
      {ExecutePlan({{0, 5}}, {{0, 3}, {3, 5}}), false, "deep to shallow"},
      {ExecutePlan({{0, 4}}, {{0, 5}}), false, "must end at layer 5"},
      {ExecutePlan({{1, 5}}, {{0, 5}}), false, "must begin at layer 0"},
      {ExecutePlan({{0, 5}}, {{3, 5}, {0, 2}}), false, "must end where the previous"},
      {ExecutePlan({{0, 5}}, {}), false, "backward plan is empty"},
      {ExecutePlan({{0, 0}, {0, 5}}, {{0, 5}}), false, "is empty"},
      {ExecutePlan({{0, 5}}, {{3, 5}, {0, 3}}), true, "fused tail stage backward[0]"},
      {ExecutePlan({{0, 2}}, {{0, 5}}), true, "forward plan must be empty"},
  };
  for (const auto& c : cases) {
    const auto message = error_of(c.plan, 5, c.fused);
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << c.plan.to_string() << " gave: " << message;
  }
}

TEST(ExecutePlan, DefaultPlanIsAsymmetric) {
  // 12 equal layers on 2 devices: forward stages hold more layers than
  // backward stages (recompute + backward ~ 3x a forward).
  const std::vector<int64_t> bytes(12, 1000);
  for (bool fused : {false, true}) {
    auto plan = ExecutePlan::from_layer_costs(bytes, 2, fused);
    plan.validate(12, fused);
    double fwd = 0, bwd = 0;
    for (const auto& r : plan.forward) fwd += r.size();
    for (const auto& r : plan.backward) bwd += r.size();
    fwd /= plan.forward.size();
    bwd /= plan.backward.size();
    // (The round-robin schedule the planner simulates also favours few
    // stages, so the ratio is below the 3x of equal stage times.)
    EXPECT_GE(fwd / bwd, 1.5) << plan.to_string();
    EXPECT_GE(plan.forward.size() + plan.backward.size(), 2u) << plan.to_string();
  }
}

TEST(ExecutePlan, DefaultPlanIsolatesAHeavyLayer) {
  std::vector<int64_t> bytes(8, 100);
  bytes[5] = 5000;
  // With at least as many devices as possible stages the cost is set by the
  // slowest stage, which is least with the heavy layer alone.
  auto plan = ExecutePlan::from_layer_costs(bytes, 16, false);
  plan.validate(8, false);
  for (const auto& r : plan.backward) {
    if (r.begin <= 5 && 5 < r.end) EXPECT_EQ(r.size(), 1) << plan.to_string();
  }
}

}  // namespace
}  // namespace roundpipe

#include "roundpipe/execute_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <set>
#include <sstream>

#include "roundpipe/run_config.h"

namespace roundpipe {
namespace {

std::string range_text(const LayerRange& r) {
  return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
}

// Packs layers [0, end) into ascending stages of cost <= budget (a stage
// holds at least one layer).
std::vector<LayerRange> pack_ascending(const std::vector<double>& cost, int end, double budget) {
  std::vector<LayerRange> stages;
  int begin = 0;
  double load = 0;
  for (int l = 0; l < end; ++l) {
    if (l > begin && load + cost[l] > budget) {
      stages.push_back({begin, l});
      begin = l;
      load = 0;
    }
    load += cost[l];
  }
  if (end > begin) stages.push_back({begin, end});
  return stages;
}

// Packs layers [0, L) into stages listed deep to shallow.
std::vector<LayerRange> pack_descending(const std::vector<double>& cost, double budget) {
  std::vector<LayerRange> stages;
  const int L = static_cast<int>(cost.size());
  int end = L;
  double load = 0;
  for (int l = L - 1; l >= 0; --l) {
    if (l < end - 1 && load + cost[l] > budget) {
      stages.push_back({l + 1, end});
      end = l + 1;
      load = 0;
    }
    load += cost[l];
  }
  if (end > 0) stages.push_back({0, end});
  return stages;
}

double max_stage_cost(const std::vector<LayerRange>& stages, const std::vector<double>& cost) {
  double worst = 0;
  for (const auto& s : stages) {
    double load = 0;
    for (int l = s.begin; l < s.end; ++l) load += cost[l];
    worst = std::max(worst, load);
  }
  return worst;
}

}  // namespace

void ExecutePlan::validate(int num_layers, bool fused) const {
  const std::string what = fused ? "execute plan for forward_backward" : "execute plan";
  TORCH_CHECK(num_layers >= 1, "a RoundPipe model needs at least one layer");
  TORCH_CHECK(!backward.empty(), "invalid ", what, " ", to_string(),
              ": the backward plan is empty; it must cover layers [0, ", num_layers, ")");
  for (const auto& r : forward) {
    TORCH_CHECK(r.begin < r.end, "invalid ", what, " ", to_string(), ": forward stage ",
                range_text(r), " is empty");
  }
  for (const auto& r : backward) {
    TORCH_CHECK(r.begin < r.end, "invalid ", what, " ", to_string(), ": backward stage ",
                range_text(r), " is empty");
  }
  TORCH_CHECK(backward.front().end == num_layers, "invalid ", what, " ", to_string(),
              ": the backward plan lists stages deep to shallow, so its first stage must end at ",
              num_layers, " (the number of layers), not ", backward.front().end);
  for (size_t i = 1; i < backward.size(); ++i) {
    TORCH_CHECK(backward[i].end == backward[i - 1].begin, "invalid ", what, " ", to_string(),
                ": backward stage ", range_text(backward[i]),
                " must end where the previous (deeper) stage ", range_text(backward[i - 1]),
                " begins");
  }
  TORCH_CHECK(backward.back().begin == 0, "invalid ", what, " ", to_string(),
              ": the last backward stage must begin at layer 0");
  const int forward_end = fused ? backward.front().begin : num_layers;
  if (forward_end == 0) {
    TORCH_CHECK(forward.empty(), "invalid ", what, " ", to_string(),
                ": the fused tail stage covers every layer, so the forward plan must be empty");
    return;
  }
  TORCH_CHECK(!forward.empty(), "invalid ", what, " ", to_string(),
              ": the forward plan is empty; it must cover layers [0, ", forward_end, ")");
  TORCH_CHECK(forward.front().begin == 0, "invalid ", what, " ", to_string(),
              ": the first forward stage must begin at layer 0");
  for (size_t i = 1; i < forward.size(); ++i) {
    TORCH_CHECK(forward[i].begin == forward[i - 1].end, "invalid ", what, " ", to_string(),
                ": forward stages must ascend without gaps or overlaps, but ",
                range_text(forward[i]), " follows ", range_text(forward[i - 1]));
  }
  TORCH_CHECK(
      forward.back().end == forward_end, "invalid ", what, " ", to_string(),
      ": the forward plan must end at layer ", forward_end,
      fused ? " (where the fused tail stage backward[0] begins)" : " (the number of layers)",
      ", not ", forward.back().end);
}

std::string ExecutePlan::to_string() const {
  std::ostringstream out;
  out << "{forward: [";
  for (size_t i = 0; i < forward.size(); ++i) out << (i ? ", " : "") << range_text(forward[i]);
  out << "], backward: [";
  for (size_t i = 0; i < backward.size(); ++i) out << (i ? ", " : "") << range_text(backward[i]);
  out << "]}";
  return out.str();
}

ExecutePlan ExecutePlan::one_layer_per_stage(int num_layers, bool fused) {
  ExecutePlan plan;
  for (int l = num_layers - 1; l >= 0; --l) plan.backward.push_back({l, l + 1});
  const int forward_end = fused ? num_layers - 1 : num_layers;
  for (int l = 0; l < forward_end; ++l) plan.forward.push_back({l, l + 1});
  return plan;
}

ExecutePlan ExecutePlan::single_stage(int num_layers, bool fused) {
  ExecutePlan plan;
  plan.backward.push_back({0, num_layers});
  if (!fused) plan.forward.push_back({0, num_layers});
  return plan;
}

ExecutePlan ExecutePlan::from_layer_costs(const std::vector<int64_t>& layer_bytes, int num_devices,
                                          bool fused) {
  const int L = static_cast<int>(layer_bytes.size());
  TORCH_CHECK(L >= 1, "a RoundPipe model needs at least one layer");
  // Forward cost ~ bytes; a backward (or fused tail) layer ~ 3x: recompute
  // (or forward) plus a backward of about twice the forward.
  std::vector<double> fwd(L), bwd(L);
  for (int l = 0; l < L; ++l) {
    fwd[l] = static_cast<double>(std::max<int64_t>(layer_bytes[l], 1));
    bwd[l] = 3 * fwd[l];
  }
  // Candidate stage budgets: every sum of consecutive layer costs.
  std::set<double> budgets;
  for (const auto* cost : {&fwd, &bwd}) {
    for (int i = 0; i < L; ++i) {
      double sum = 0;
      for (int j = i; j < L; ++j) budgets.insert(sum += (*cost)[j]);
    }
  }
  ExecutePlan best;
  double best_cost = std::numeric_limits<double>::infinity();
  size_t best_stages = 0;
  for (double budget : budgets) {
    ExecutePlan plan;
    plan.backward = pack_descending(bwd, budget);
    plan.forward = pack_ascending(fwd, fused ? plan.backward.front().begin : L, budget);
    const size_t stages = plan.forward.size() + plan.backward.size();
    const double stage_time =
        std::max(max_stage_cost(plan.forward, fwd), max_stage_cost(plan.backward, bwd));
    // Round-robin over D devices: about max(stages, D) stage slots of the
    // slowest stage's time.
    const double cost = static_cast<double>(std::max<size_t>(stages, num_devices)) * stage_time;
    if (cost < best_cost * (1 - 1e-9) || (cost <= best_cost * (1 + 1e-9) && stages < best_stages)) {
      best = plan;
      best_cost = cost;
      best_stages = stages;
    }
  }
  return best;
}

RunConfig RunConfig::overriding(const RunConfig& model) const {
  RunConfig out = model;
  if (requires_grad) out.requires_grad = requires_grad;
  if (output_device) out.output_device = output_device;
  if (preserve_rng_state) out.preserve_rng_state = preserve_rng_state;
  if (recompute_grain) out.recompute_grain = recompute_grain;
  if (num_microbatch) out.num_microbatch = num_microbatch;
  if (split_input) out.split_input = split_input;
  if (split_label) out.split_label = split_label;
  if (merge_output) {
    out.merge_output = merge_output;
    out.pack_output.reset();  // a call's own merge replaces the model's packing
  }
  if (pack_output) out.pack_output = pack_output;
  if (packed_input) out.packed_input = packed_input;
  if (execute_plan) out.execute_plan = execute_plan;
  return out;
}

}  // namespace roundpipe

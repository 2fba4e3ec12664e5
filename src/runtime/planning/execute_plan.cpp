#include "roundpipe/execute_plan.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace roundpipe {
namespace {

std::string range_text(const LayerRange& r) {
  return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
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
  TORCH_CHECK(tail_replicas >= 1, "invalid ", what, " ", to_string(),
              ": tail_replicas must be at least 1, got ", tail_replicas);
  TORCH_CHECK(tail_replicas == 1 || (fused && backward.size() == 1 && backward[0].begin == 0),
              "invalid ", what, " ", to_string(), ": tail_replicas > 1 needs forward_backward ",
              "and a plan whose fused tail stage is the whole model ({forward: [], backward: [[0, ",
              num_layers, ")]})");
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
  out << "]";
  if (tail_replicas > 1) out << ", tail_replicas: " << tail_replicas;
  out << "}";
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

}  // namespace roundpipe

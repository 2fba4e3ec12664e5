// Which layers each pipeline stage runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace roundpipe {

// Layers [begin, end) of the model: half-open, like Python's range().
struct LayerRange {
  int begin = 0;
  int end = 0;
  int size() const { return end - begin; }
  bool operator==(const LayerRange&) const = default;
};

// A forward plan (ascending ranges) and a backward plan (ranges listed deep
// to shallow). In fused mode (forward_backward) backward[0] is the fused tail
// stage, which runs forward + loss + backward without recompute, and the
// forward plan covers only the layers before it.
struct ExecutePlan {
  std::vector<LayerRange> forward;
  std::vector<LayerRange> backward;
  // forward_backward only, when the fused tail stage is the whole model:
  // it runs on this many devices at once, each taking every k-th
  // microbatch (microbatch m on replica m mod k), and their parameter
  // gradients add up on the host. No recompute and no pipeline: for a model
  // whose stage fits one device, this is how a second device helps most.
  int tail_replicas = 1;

  ExecutePlan() = default;
  ExecutePlan(std::vector<LayerRange> fwd, std::vector<LayerRange> bwd)
      : forward(std::move(fwd)), backward(std::move(bwd)) {}

  // Throws a c10::Error naming what is wrong unless the plan fits a model of
  // `num_layers` layers (fused: whether it is meant for forward_backward).
  void validate(int num_layers, bool fused) const;
  std::string to_string() const;

  // Every layer its own stage.
  static ExecutePlan one_layer_per_stage(int num_layers, bool fused);
  // The whole model in one forward stage and one backward stage.
  static ExecutePlan single_stage(int num_layers, bool fused);
  // The default asymmetric plan from per-layer costs (bytes stand in for
  // times before any timing exists): backward stages recompute and
  // back-propagate (about 3x a forward), so forward stages hold about three
  // times the layers of backward stages and all stages take similar time.
  // The planner's automatic plan on those costs (defined with the planner,
  // src/runtime/planning/planner.cpp).
  static ExecutePlan from_layer_costs(const std::vector<int64_t>& layer_bytes, int num_devices,
                                      bool fused);
};

}  // namespace roundpipe

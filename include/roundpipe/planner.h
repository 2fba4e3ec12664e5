// The automatic execute plan (REFERENCE.md section 5, plus what the original
// leaves out): stage workloads balanced on per-layer compute costs, under a
// device-memory limit that counts parameters, gradients and activations, with
// a stage's parameter upload hidden behind the compute before it.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "roundpipe/execute_plan.h"

namespace roundpipe {

// What one layer costs. Times in seconds (or any one unit; before any timing,
// bytes stand in: forward = recompute = bytes, backward = 2 x bytes).
struct LayerCost {
  double forward = 0;
  double recompute = 0;
  double backward = 0;
  int64_t param_bytes = 0;       // parameters + buffers uploaded with the layer
  int64_t grad_bytes = 0;        // gradients a backward stage accumulates on the device
  int64_t activation_bytes = 0;  // one microbatch's activations kept for its backward (0: unknown)
  int64_t working_bytes = 0;     // the most its forward or backward holds beyond that, at once
  int64_t output_bytes = 0;      // one microbatch's output (the next layer's input; 0: unknown)
  // Of activation_bytes, what does not shrink with a microbatch's rows
  // (note_kept_bytes_independent_of_rows): a chunk of rows keeps it whole.
  int64_t activation_bytes_independent_of_rows = 0;
};

struct PlanRequest {
  int num_devices = 1;
  bool fused = false;  // for forward_backward (backward[0] is the fused tail stage)
  // Device memory a model may use, per device; 0 = unlimited. A stage runs
  // while the next stage on its device has its parameters arriving: a plan
  // fits when every stage's memory plus those parameters do.
  int64_t memory_limit_bytes = 0;
  // Recompute in layer grain: a backward stage holds one layer's kept
  // activations at a time (stage grain: all of its layers').
  bool layer_grain = false;
  // With layer_grain: the host keeps only each backward stage's input, and
  // a backward stage reruns its layers but the last without grad to find
  // their inputs (RecomputeGrain::kLayerFromStage): one more forward each.
  bool rerun_from_stage_input = false;
  // With rerun_from_stage_input: the host memory the call's checkpoints
  // (each backward stage's input, every microbatch: PlanEstimate::
  // checkpoint_bytes) may take. > 0: the fastest plan within it, else the
  // one with the fewest; 0: the fewest checkpoints, then the fastest (what
  // a caller who asks for this grain wants, Note [Thin checkpoints]).
  int64_t host_checkpoint_limit_bytes = 0;
  // With rerun_from_stage_input: a backward stage (not the fused tail)
  // keeps the inputs of its layers but the last, of the microbatch it runs,
  // on the device, where the host held them: its memory counts them
  // (LayerCost::output_bytes). Set once activations are measured.
  bool rerun_inputs_on_device = false;
  // With layer_grain, fused, a limit and measured activations: the fused
  // tail runs as many of its last layers with grad as the limit holds
  // (StageEstimate::layers_with_grad), saving their recompute.
  bool grow_tail_with_grad = false;
  // With grow_tail_with_grad: the rows of the smallest microbatch, which a
  // fused tail beginning at or after first_row_split_layer may run in
  // chunks of rows (Note [Tail row chunks], layer.h); <= 1: no chunks.
  int tail_rows = 0;
  // ... and of the largest (0: tail_rows). A layer's measured activations
  // are the largest microbatch's, and its chunks take the largest share of
  // them: 10 rows in 4 microbatches are 3, 3, 2 and 2, and in 2 chunks a
  // 3-row microbatch's first chunk keeps 2/3 of its activations, not 1/2.
  int tail_rows_largest = 0;
  int first_row_split_layer = std::numeric_limits<int>::max();
  // The layers' activation_bytes are not measured (yet): the plan keeps
  // this share of the limit for them.
  bool activations_unmeasured = false;
  double unmeasured_activation_share = 0.5;
  // Host-to-device bytes per second for parameter uploads; 0 = free.
  double upload_bytes_per_second = 0;
  // Microbatches per call: a stage computes this many times per upload.
  int num_microbatches = 2;
  int min_stages = 0;  // at least this many stages in all
  // May the plan run the whole model as one fused stage on several devices
  // (ExecutePlan::tail_replicas)? Only where no layer writes its buffers.
  bool allow_tail_replicas = false;
  // The plan in use, if any: kept while it fits and predicts within
  // keep_within (a fraction) of the best.
  const ExecutePlan* incumbent = nullptr;
  double keep_within = 0.03;
};

// One stage of a plan with its predicted time and memory.
struct StageEstimate {
  LayerRange range;
  bool backward = false;     // a backward (or fused tail) stage
  double compute = 0;        // its compute time for one microbatch
  double upload = 0;         // its parameter upload time
  int64_t memory_bytes = 0;  // while it runs (parameters, gradients, activations)
  int64_t param_bytes = 0;   // of its parameters
  // memory_bytes plus the parameters of the stage arriving meanwhile on its
  // device: what a plan fits the limit with.
  int64_t peak_bytes = 0;
  // The fused tail in layer grain with PlanRequest::grow_tail_with_grad: how
  // many of its last layers run with grad, keeping their activations (the
  // rest are recomputed one at a time); 0 where not set.
  int layers_with_grad = 0;
  // ... and in how many chunks of rows it runs each microbatch (1: whole).
  int row_chunks = 1;
};

struct PlanEstimate {
  ExecutePlan plan;
  std::vector<StageEstimate> stages;  // forward stages in order, then backward deep to shallow
  double iteration = 0;               // predicted time per call of back-to-back calls (round-robin)
  // Host bytes of the call's checkpoints: the inputs kept for its backward
  // stages but the fused tail (every layer's in layer grain, else each
  // stage's), all microbatches; from LayerCost::output_bytes.
  int64_t checkpoint_bytes = 0;
  int checkpoint_inputs = 0;  // how many layer inputs of a microbatch those are
  // PlanRequest::rerun_inputs_on_device, which the stages' memory counts.
  bool rerun_inputs_on_device = false;
  // One line per stage (layers, compute, upload, memory) and the totals.
  std::string describe() const;
  // The largest stage's peak_bytes: the plan's predicted device peak.
  int64_t largest_peak_bytes() const;
};

// The cheapest plan whose every stage's peak_bytes fits the memory limit
// (less PlanRequest::unmeasured_activation_share of it while activations
// are unmeasured). Throws a c10::Error naming
// the smallest feasible limit when even one-layer stages do not fit.
PlanEstimate plan_stages(const std::vector<LayerCost>& layers, const PlanRequest& request);

// The memory limit at which one layer per stage fits (what plan_stages'
// error names): the largest one-layer backward stage plus the largest
// layer's parameters arriving meanwhile, doubled while activations are
// unmeasured.
int64_t smallest_feasible_memory_limit(const std::vector<LayerCost>& layers,
                                       const PlanRequest& request);

// The predicted stages and time of a given plan (e.g. a hand-written one).
PlanEstimate estimate_plan(const std::vector<LayerCost>& layers, const ExecutePlan& plan,
                           const PlanRequest& request);

// The stand-in costs before any timing: from each layer's parameter and
// buffer bytes and its trainable bytes.
std::vector<LayerCost> costs_from_bytes(const std::vector<int64_t>& layer_bytes,
                                        const std::vector<int64_t>& layer_grad_bytes);

}  // namespace roundpipe

// The automatic plan of an engine: plan_stages() (planner.h) fed with the
// model's per-layer costs (parameter bytes until every layer has measured
// times, then the measured times and the link's upload rate), its memory
// limit, and the plan cache that keeps a plan in use while a new one would
// not be clearly faster; with `verbose`, each new plan logged with its
// costs. Internal header.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/layer.h"
#include "roundpipe/options.h"
#include "roundpipe/planner.h"
#include "runtime/parts/commit_ledger.h"
#include "runtime/parts/weight_table.h"
#include "runtime/planning/layer_timings.h"
#include "runtime/recovery/out_of_memory.h"

namespace roundpipe::detail {

// The rows of a call's smallest and largest microbatch, for a fused tail
// that may run them in chunks of rows (PlanRequest::tail_rows,
// tail_rows_largest); 0: none.
struct TailRows {
  int smallest = 0, largest = 0;
  TailRows() = default;
  TailRows(int rows) : smallest(rows), largest(rows) {}  // every microbatch's
  TailRows(int smallest_rows, int largest_rows) : smallest(smallest_rows), largest(largest_rows) {}
};

class AutoPlan {
 public:
  // Probes the host-to-device rate and reads the devices' free memory now,
  // before any work of the engine competes for either.
  AutoPlan(const std::string& name, const RoundPipeOptions& options, const DevicePool& pool,
           const std::vector<LayerPtr>& layers, const WeightTable& weights,
           const LayerTimings& timings, const CommitLedger& commits);

  // The automatic plan with its predicted stage times and memory, under
  // `memory_limit_gib` (default: model_memory_limit, else what the smallest
  // device had left when the engine was made), for calls of
  // `num_microbatches` in `grain` (`grow_tail`: the plan chose layer grain,
  // and may run more of the fused tail with grad, Note [Tail grain]).
  // `tail_rows`: where the call's loss adds up over rows, its microbatches'
  // (TailRows), else none.
  PlanEstimate estimate(bool fused, int num_microbatches, int min_stages,
                        std::optional<double> memory_limit_gib, RecomputeGrain grain,
                        bool grow_tail = false, TailRows tail_rows = {}) const;
  // The plan of a call that brings none, and the grain it runs in: `grain`
  // if the caller chose one, else the plan's choice (Note [Automatic
  // grain]). The plan in use for (fused, microbatches, grain) stays unless
  // a new one is clearly faster.
  struct CallPlan {
    ExecutePlan plan;
    RecomputeGrain grain;
    int tail_layers_with_grad = 0;        // Note [Tail grain]; 0: one, in layer grain
    int tail_row_chunks = 1;              // Note [Tail row chunks]
    bool rerun_inputs_on_device = false;  // PlanEstimate::rerun_inputs_on_device
    int64_t predicted_peak_bytes = 0;     // PlanEstimate::largest_peak_bytes
  };
  CallPlan for_call(bool fused, int num_microbatches, std::optional<RecomputeGrain> grain,
                    TailRows tail_rows = {});
  // The estimate for_call's choice rests on (without the plan cache's
  // bias to the plan in use unless unconstrained), and the grain chosen.
  struct Choice {
    PlanEstimate estimate;
    RecomputeGrain grain;
  };
  Choice choose(bool fused, int num_microbatches, int min_stages,
                std::optional<double> memory_limit_gib, std::optional<RecomputeGrain> grain,
                TailRows tail_rows = {}) const;
  // A call on `failed` in `grain` (chosen by this plan or not) ran out of
  // memory: later plans are smaller (Note [Out-of-memory redo]).
  void shrink_after_out_of_memory(const ExecutePlan& failed, RecomputeGrain grain,
                                  bool grain_chosen);
  // Host-to-device bytes per second (0: the probe failed; uploads count as free).
  double upload_bytes_per_second() const { return upload_bytes_per_second_; }

 private:
  double probe_upload_rate() const;
  // Every layer's times, kept activations and backward working memory are
  // measured, and every layer can be (Note [Backward working memory]).
  bool activations_measured() const;
  // The room the host has for a call's checkpoints (Note [Host room for
  // checkpoints]).
  int64_t host_checkpoint_room() const;
  // `plan`, packed on `request` with activations unmeasured, its stages'
  // memory counting the backwards that allocated the gradients where those
  // are measured (Note [One microbatch a call]); else `plan` as it is.
  PlanEstimate counting_first_backwards(PlanEstimate plan, PlanRequest request) const;
  // Activations are unmeasured for `request` (or some layer cannot be
  // metered: then no), and the backwards that allocated the gradients are
  // measured: they may stand in (Note [One microbatch a call]).
  bool first_backwards_stand_in(const PlanRequest& request) const;
  void log(bool fused, int num_microbatches, bool measured, const PlanEstimate& estimate);

  const std::string& name_;
  const RoundPipeOptions& options_;
  const DevicePool& pool_;
  const WeightTable& weights_;
  const LayerTimings& timings_;
  const CommitLedger& commits_;
  bool all_layers_meterable_ = true;  // else the planner keeps half the limit for activations
  // The first layer from which on every layer splits its input by rows.
  int first_row_split_layer_ = 0;
  // The memory limit of plans without model_memory_limit (0: unlimited).
  int64_t default_memory_limit_bytes_ = 0;
  double upload_bytes_per_second_ = 0;
  mutable std::mutex mu_;
  using PlanKey = std::tuple<bool, int, RecomputeGrain>;  // fused, microbatches, grain
  std::map<PlanKey, ExecutePlan> plans_in_use_;
  std::string logged_plans_[2];  // verbose: the last plan logged (forward, fused)
  PlanShrink shrink_;            // after calls ran out of memory (out_of_memory.h)
  // The host had no room for layer grain's checkpoints once: the automatic
  // grain stays layer-from-stage (the room it leaves would flip it back).
  mutable std::atomic<bool> thin_for_host_{false};
};

}  // namespace roundpipe::detail

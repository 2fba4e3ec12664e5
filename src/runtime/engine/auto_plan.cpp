// The engine's automatic plan: see auto_plan.h.
#include "runtime/engine/auto_plan.h"

#include "device/staging_ring.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>

namespace roundpipe::detail {

AutoPlan::AutoPlan(const std::string& name, const RoundPipeOptions& options, const DevicePool& pool,
                   const std::vector<LayerPtr>& layers, const WeightTable& weights,
                   const LayerTimings& timings, const CommitLedger& commits)
    : name_(name),
      options_(options),
      pool_(pool),
      weights_(weights),
      timings_(timings),
      commits_(commits) {
  TORCH_CHECK(!options_.host_checkpoint_limit_gib || *options_.host_checkpoint_limit_gib > 0, name_,
              ": host_checkpoint_limit must be positive (GiB), got ",
              options_.host_checkpoint_limit_gib.value_or(0));
  all_layers_meterable_ = std::all_of(layers.begin(), layers.end(),
                                      [](const LayerPtr& layer) { return layer->meterable(); });
  first_row_split_layer_ = static_cast<int>(layers.size());
  while (first_row_split_layer_ > 0 && layers[first_row_split_layer_ - 1]->row_splitter())
    --first_row_split_layer_;
  // What the smallest device has left now, before this engine's work (0:
  // unlimited), less a tenth (the driver's context, fragmentation, the
  // downloads in flight). Measured at plan time it would exclude what the
  // calls in flight hold, which the plan's stages reuse.
  for (int d = 0; d < pool_.size(); ++d) {
    const auto stats = pool_.at(d)->memory_stats();
    if (stats.budget_bytes <= 0) continue;
    const int64_t left = (stats.budget_bytes - stats.in_use_bytes) / 10 * 9;
    if (default_memory_limit_bytes_ == 0 || left < default_memory_limit_bytes_)
      default_memory_limit_bytes_ = left;
  }
  // The link's rate, measured now, while nothing else runs: probed beside
  // the first update's CPU Adam and gradient sums it measures a fraction
  // of the link (docs/architecture.md, where the code stands).
  upload_bytes_per_second_ = probe_upload_rate();
}

PlanEstimate AutoPlan::estimate(bool fused, int num_microbatches, int min_stages,
                                std::optional<double> memory_limit_gib, RecomputeGrain grain,
                                bool grow_tail, TailRows tail_rows) const {
  const bool callers_question = min_stages != 0 || memory_limit_gib.has_value();
  PlanRequest request;
  // The default plan's question (no constraints of the caller's own): the
  // plan in use stays unless a new one is clearly faster.
  std::optional<ExecutePlan> incumbent;
  if (min_stages == 0 && !memory_limit_gib) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = plans_in_use_.find(PlanKey{fused, num_microbatches, grain});
    if (it != plans_in_use_.end()) incumbent = it->second;
  }
  if (incumbent) request.incumbent = &*incumbent;
  // Replicated tails only once a call has shown that no layer writes its
  // buffers (or there are none); ROUNDPIPE_TAIL_REPLICAS=0 turns them off.
  static const bool replicas_enabled = [] {
    const char* v = std::getenv("ROUNDPIPE_TAIL_REPLICAS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  // (Committed read first: a call's last commit sets it after any of its
  // commits saw a write.)
  const bool committed = commits_.training_call_committed();
  request.allow_tail_replicas =
      replicas_enabled && (committed || !weights_.has_buffers()) && !commits_.buffers_written();
  request.num_devices = pool_.size();
  request.fused = fused;
  request.num_microbatches = num_microbatches;
  // After an out-of-memory redo (Note [Out-of-memory redo]) the plans of
  // calls are smaller; an estimate the caller constrains is not.
  PlanShrink shrink;
  if (!memory_limit_gib && min_stages == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    shrink = shrink_;
  }
  // (A shrunk stage count stops at one layer per stage: forward and
  // backward stages, less the forward of the fused tail's layer.)
  const int most_stages = 2 * static_cast<int>(weights_.layer_bytes().size()) - (fused ? 1 : 0);
  request.min_stages = std::max(min_stages, std::min(shrink.min_stages, most_stages));
  if (!memory_limit_gib) memory_limit_gib = options_.model_memory_limit_gib;
  if (memory_limit_gib) {
    TORCH_CHECK(*memory_limit_gib > 0, name_, ": model_memory_limit must be positive (GiB), got ",
                *memory_limit_gib);
    request.memory_limit_bytes = static_cast<int64_t>(*memory_limit_gib * (1 << 30));
  } else {
    request.memory_limit_bytes = default_memory_limit_bytes_;
  }
  const int64_t unshrunk_limit = request.memory_limit_bytes;
  request.layer_grain = grain != RecomputeGrain::kStage;
  request.rerun_from_stage_input = grain == RecomputeGrain::kLayerFromStage;
  // Its checkpoints: within the caller's limit for them, or within the
  // host's room where the plan chose this grain for it; the fewest where a
  // caller asked for the grain (Note [Thin checkpoints]).
  if (request.rerun_from_stage_input && (options_.host_checkpoint_limit_gib || thin_for_host_))
    request.host_checkpoint_limit_bytes = host_checkpoint_room();
  request.grow_tail_with_grad = grow_tail;
  // ROUNDPIPE_TAIL_ROW_CHUNKS=0 keeps the tail's microbatches whole: a
  // diagnostic, to time the best plan without chunks of rows beside the one
  // with them (read at each plan, so a test can set it).
  const char* row_chunks = std::getenv("ROUNDPIPE_TAIL_ROW_CHUNKS");
  if (row_chunks == nullptr || std::strcmp(row_chunks, "0") != 0) {
    request.tail_rows = tail_rows.smallest;
    request.tail_rows_largest = tail_rows.largest;
  }
  request.first_row_split_layer = first_row_split_layer_;
  // Measured times once every layer has them (with the measured upload
  // rate, in the same unit), else bytes stand in. Until what layers keep
  // for their backward and their backward's working memory are measured
  // (Note [Backward working memory]; or where a layer cannot be metered),
  // part of the limit is held back for them.
  const bool measured = timings_.complete();
  const bool still_measuring = !measured || (all_layers_meterable_ && !timings_.memory_measured());
  request.activations_unmeasured = !activations_measured();
  // The rerun's inputs go to the device once their bytes are counted there
  // (Note [Thin checkpoints]).
  request.rerun_inputs_on_device =
      request.rerun_from_stage_input && !request.activations_unmeasured;
  const auto& bytes = weights_.layer_bytes();
  const auto& grad_bytes = weights_.layer_grad_bytes();
  if (measured) request.upload_bytes_per_second = upload_bytes_per_second_;
  const auto costs =
      measured ? timings_.costs(bytes, grad_bytes) : costs_from_bytes(bytes, grad_bytes);
  // A shrunk limit stops at the smallest one that fits one layer per
  // stage: below it no plan exists, and a microbatch that still runs out
  // of memory there is retried (or the call redone) on that plan.
  if (shrink.limit_scale < 1 && unshrunk_limit > 0) {
    const auto shrunk =
        static_cast<int64_t>(static_cast<double>(unshrunk_limit) * shrink.limit_scale);
    request.memory_limit_bytes =
        std::max(shrunk, std::min(unshrunk_limit, smallest_feasible_memory_limit(costs, request)));
  }
  // The plan on `request` as it stands, or none where none fits (the
  // planner's error kept to rethrow).
  std::exception_ptr no_plan;
  auto pack = [&]() -> std::optional<PlanEstimate> {
    try {
      return plan_stages(costs, request);
    } catch (const c10::Error&) {
      no_plan = std::current_exception();
      return std::nullopt;
    }
  };
  if (fused && still_measuring && request.memory_limit_bytes > 0 && !callers_question) {
    // Note [First training call]
    request.unmeasured_activation_share = 0.75;
    if (auto packed = pack()) return counting_first_backwards(std::move(*packed), request);
    request.unmeasured_activation_share = 0.5;  // no such plan: as any unmeasured call
  }
  if (auto packed = pack()) return counting_first_backwards(std::move(*packed), request);
  // Note [One microbatch a call]: no plan holds half the limit back, and
  // only backwards that allocated the gradients were measured: plan on
  // them, within the whole limit.
  if (!first_backwards_stand_in(request)) std::rethrow_exception(no_plan);
  request.activations_unmeasured = false;
  request.rerun_inputs_on_device = request.rerun_from_stage_input;
  return plan_stages(timings_.costs(bytes, grad_bytes, /*first_backwards_stand_in=*/true), request);
}

// Note [One microbatch a call], continued: a plan packed with part of the
// limit held back for what its backwards were not measured to hold prints,
// and returns, its stages' memory counting the backwards that were
// measured, those that allocated the gradients (with their incoming
// gradient and input). The plan is the same; its estimate counts the
// backward's working memory it left out, where it fell short by 1.65-4.63
// GiB on an H100 (one row of 65,536 or 131,072 tokens: its stage memory
// counted the forward's working memory alone), and the user reading it
// sees what the calls take rather than what the plan was packed on. (Left
// to the tenth of the budget held back, as in measured plans: the fused
// tail's input, which it holds on the device through the microbatch for a
// retry; one row's hidden state, 0.25 GiB at 65,536 tokens of a
// 2,048-wide model in 16 bits.)
bool AutoPlan::first_backwards_stand_in(const PlanRequest& request) const {
  return request.activations_unmeasured && all_layers_meterable_ && timings_.complete() &&
         timings_.memory_measured(/*first_backwards_stand_in=*/true);
}

PlanEstimate AutoPlan::counting_first_backwards(PlanEstimate plan, PlanRequest request) const {
  if (!first_backwards_stand_in(request)) return plan;
  request.activations_unmeasured = false;
  request.incumbent = nullptr;
  const auto counted =
      estimate_plan(timings_.costs(weights_.layer_bytes(), weights_.layer_grad_bytes(), true),
                    plan.plan, request);
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    plan.stages[s].memory_bytes =
        std::max(plan.stages[s].memory_bytes, counted.stages[s].memory_bytes);
    plan.stages[s].peak_bytes = std::max(plan.stages[s].peak_bytes, counted.stages[s].peak_bytes);
  }
  return plan;
}

// Note [First training call]
// Until a call has measured what each layer keeps for its backward, the
// plan cannot tell how much of the device a stage's activations take: one
// layer with grad of a 32B model over a 32,768-token microbatch keeps
// about 10 GiB, half a 24 GiB card, while a 1.7B layer keeps 1.5 GiB. The
// plan on parameter bytes with half the limit held back for activations
// ran out of memory on the first call at 32B (its tail asked 1.56 GiB more
// with 20.99 GiB allocated: its parameters and the next stage's took the
// other half). So under a memory limit, a forward_backward before the
// measurement packs its stages (with the next stage's parameters) into a
// quarter of the limit, three quarters held back for one layer's
// activations and working memory; where no such plan exists, into half.
// One layer per stage would hold less still, but each backward stage's
// input is a checkpoint on the host: at 32B in layer-from-stage grain it
// kept 41 GiB there (every layer's input) in that first call, which the
// later calls then did not need (H100, 2026-12-05). The measured plan
// comes once every layer's kept activations and backward working memory
// are measured (Note [Backward working memory]): the next call where calls
// have two or more microbatches.

// Note [Automatic grain]
// Where the caller sets no recompute_grain, the plan chooses it. Until
// every layer's kept activations are measured, the planner cannot tell
// what a stage-grain backward stage (or fused tail) holds: it may be many
// times its parameters (a 29-layer tail of a 1.7B model over 16K tokens
// keeps ~37 GB), so calls run in layer grain, which holds one layer's
// activations at a time. Once measured, stage grain is taken where its plan
// fits the limit and is predicted no slower; else layer grain.
//
// A caller's "stage" (the original's benchmark/train.py passes it) is kept
// where the plan can size it: its first call, before the activations are
// measured, runs in layer grain too, and later calls in stage grain on
// stages that fit; where no stage-grain plan fits the limit, layer grain.
// The grain decides what is kept and recomputed, never the results (the
// recompute replays the forward's random streams), so this is invisible
// but for memory: an unmeasured stage-grain plan ran out of memory on the
// first calls of every capped run.
AutoPlan::Choice AutoPlan::choose(bool fused, int n, int min_stages,
                                  std::optional<double> memory_limit_gib,
                                  std::optional<RecomputeGrain> grain, TailRows tail_rows) const {
  const bool activations_measured = this->activations_measured();
  bool layer_grain_only = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    layer_grain_only = shrink_.layer_grain_only;
  }
  const bool stage_asked = grain == RecomputeGrain::kStage && all_layers_meterable_;
  if (stage_asked && activations_measured) {
    try {
      return {estimate(fused, n, min_stages, memory_limit_gib, RecomputeGrain::kStage),
              RecomputeGrain::kStage};
    } catch (const c10::Error&) {
      // No stage-grain plan fits the limit: layer grain.
    }
  }
  const bool plan_chooses = !grain || stage_asked;
  RecomputeGrain chosen = plan_chooses ? RecomputeGrain::kLayer : *grain;
  auto plan = estimate(fused, n, min_stages, memory_limit_gib, chosen,
                       /*grow_tail=*/chosen != RecomputeGrain::kLayer || plan_chooses, tail_rows);
  if (!grain && !layer_grain_only && activations_measured) {
    try {
      auto stage = estimate(fused, n, min_stages, memory_limit_gib, RecomputeGrain::kStage);
      if (stage.iteration <= plan.iteration) {
        plan = std::move(stage);
        chosen = RecomputeGrain::kStage;
      }
    } catch (const c10::Error&) {
      // No stage-grain plan fits the limit: layer grain.
    }
  }
  // Note [Host room for checkpoints]
  // Layer grain keeps every layer's input of every microbatch on the host
  // from a call's forward to its backward: 41 GiB a call for a 32B model
  // over 16 x 4096 tokens, which a 64 GiB workstation holding the model's
  // state does not have. Where the plan chooses the grain and layer grain's
  // checkpoints (measured output bytes) would take more than the host's
  // room for them, calls run in layer-from-stage grain (Note [Thin
  // checkpoints]): the same device memory, each backward stage's input
  // only, at one more forward of the stages' other layers. Once chosen it
  // stays: the room it leaves would otherwise flip the next plan back.
  // (Output bytes are measured with the times, also where activations
  // cannot be: Python layers always run in layer grain.)
  if (plan_chooses && chosen == RecomputeGrain::kLayer && timings_.complete() && min_stages == 0 &&
      !memory_limit_gib) {
    bool thin = thin_for_host_;
    if (!thin) {
      const int64_t room = host_checkpoint_room();
      thin = room > 0 && plan.checkpoint_bytes > room;
      if (thin && options_.verbose)
        std::fprintf(stderr,
                     "%s: layer grain's checkpoints (%.2f GiB a call) exceed the host's room for "
                     "them (%.2f GiB): calls keep each backward stage's input only "
                     "(layer_from_stage grain)\n",
                     name_.c_str(), plan.checkpoint_bytes / 1073741824.0, room / 1073741824.0);
    }
    if (thin) {
      thin_for_host_ = true;
      auto rerun = estimate(fused, n, min_stages, memory_limit_gib, RecomputeGrain::kLayerFromStage,
                            /*grow_tail=*/true, tail_rows);
      return {std::move(rerun), RecomputeGrain::kLayerFromStage};
    }
  }
  return {std::move(plan), chosen};
}

bool AutoPlan::activations_measured() const {
  return all_layers_meterable_ && timings_.complete() && timings_.memory_measured();
}

int64_t AutoPlan::host_checkpoint_room() const {
  if (options_.host_checkpoint_limit_gib)
    return std::max<int64_t>(static_cast<int64_t>(*options_.host_checkpoint_limit_gib * (1 << 30)),
                             1);
  // Three quarters of what the host could give now: its available memory
  // and the arena's free blocks (the last call's checkpoints went back
  // there). The rest is for the step's staging, the hand-offs in flight
  // and everything else the process and the host run.
  int64_t available = 0;
  if (FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    long long kib = 0;
    while (std::fgets(line, sizeof(line), f)) {
      if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) {
        available = static_cast<int64_t>(kib) * 1024;
        break;
      }
    }
    std::fclose(f);
  }
  if (available == 0) return 0;  // unknown: no limit
  const auto arena = weights_.host_memory_stats().arena;
  available += std::max<int64_t>(arena.reserved_bytes - arena.allocated_bytes, 0);
  return available / 4 * 3;
}

AutoPlan::CallPlan AutoPlan::for_call(bool fused, int n, std::optional<RecomputeGrain> grain,
                                      TailRows tail_rows) {
  // Read before planning: timings that complete in between make this log
  // say "bytes" once more, and the next call logs the measured plan.
  const bool measured = timings_.complete();
  auto [plan, chosen] = choose(fused, n, 0, std::nullopt, grain, tail_rows);
  {
    std::lock_guard<std::mutex> lock(mu_);
    plans_in_use_[PlanKey{fused, n, chosen}] = plan.plan;
  }
  if (options_.verbose) log(fused, n, measured, plan);
  CallPlan call{plan.plan, chosen};
  call.rerun_inputs_on_device = plan.rerun_inputs_on_device;
  call.predicted_peak_bytes = plan.largest_peak_bytes();
  if (!fused || plan.stages.empty()) return call;
  const auto& tail = plan.stages.at(plan.plan.forward.size());
  call.tail_layers_with_grad = tail.layers_with_grad;
  call.tail_row_chunks = tail.row_chunks;
  return call;
}

// Later plans smaller: Note [Out-of-memory redo] (out_of_memory.h).
void AutoPlan::shrink_after_out_of_memory(const ExecutePlan& failed, RecomputeGrain grain,
                                          bool grain_chosen) {
  std::lock_guard<std::mutex> lock(mu_);
  shrink_ = next_shrink(shrink_, failed, grain, grain_chosen,
                        default_memory_limit_bytes_ > 0 || options_.model_memory_limit_gib);
  plans_in_use_.clear();  // the plans in use are what ran out of memory
}

void AutoPlan::log(bool fused, int n, bool measured, const PlanEstimate& estimate) {
  std::lock_guard<std::mutex> lock(mu_);
  // Logged when the plan changes, and once when timings first replace the
  // byte estimate even if the plan stays: the measured per-layer costs are
  // what a user hand-tunes from.
  const std::string key = (measured ? "measured " : "estimated ") + estimate.plan.to_string();
  auto& logged = logged_plans_[fused ? 1 : 0];
  if (logged == key) return;
  logged = key;
  std::fprintf(stderr, "%s: %s plan for %d microbatches on %d device(s), costs %s\n%s%s\n",
               name_.c_str(), fused ? "forward_backward" : "forward", n, pool_.size(),
               measured ? "measured (seconds):" : "from parameter bytes (no timings yet):",
               measured ? timings_.describe().c_str() : "", estimate.describe().c_str());
}

double AutoPlan::probe_upload_rate() const {
  // A parameter-sized upload (1-64 MiB: a layer's parameters).
  const auto& layer_bytes = weights_.layer_bytes();
  int64_t total = 0;
  for (int64_t b : layer_bytes) total += b;
  auto& device = *pool_.at(0);
  // At most an eighth of a small device's memory (a simulated one may
  // have a few KiB).
  const int64_t budget = device.memory_stats().budget_bytes;
  const int64_t bytes = std::min<int64_t>(
      std::clamp<int64_t>(total / std::max<int64_t>(static_cast<int64_t>(layer_bytes.size()), 1),
                          1 << 20, 64 << 20),
      budget > 0 ? std::max<int64_t>(budget / 8, 1) : int64_t{64} << 20);
  // Pinned as the homes are (not from the arena, which then holds the
  // model alone). Pageable homes are uploaded through a staging ring, whose
  // CPU copies count: that probe is timed on the host, from enqueuing the
  // upload to its completion.
  const bool staged = weights_.pageable_homes();
  const bool pinned = !staged && device.supports_pinned_memory();
  auto host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
  host.zero_();
  std::unique_ptr<StagingRing> ring;
  if (staged) {
    ring = std::make_unique<StagingRing>(
        kStagingSlots, staging_slot_bytes(weights_.host_memory_stats().model_state_bytes),
        device.supports_pinned_memory(), kStagingThreads);
  }
  // The copy alone, timed on its queue, the fastest of three after one
  // that pays for allocation. A probe that fails leaves the rate unknown
  // (0: uploads count as free), it does not fail the engine.
  double seconds = 0;
  try {
    for (int i = 0; i < 4; ++i) {
      for (Queue q : {Queue::kCompute, Queue::kDownload, Queue::kParamUpload})
        device.record(q)->synchronize();
      const auto wall_start = std::chrono::steady_clock::now();
      auto start = device.record_timing_mark(Queue::kParamUpload);
      auto [copy, done] = device.upload(Queue::kParamUpload, {host}, nullptr, ring.get());
      auto end = device.record_timing_mark(Queue::kParamUpload);
      done->synchronize();  // (rethrows a failed copy)
      const double s =
          staged
              ? std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count()
              : device.seconds_between(start, end);
      if (i > 0) seconds = seconds > 0 ? std::min(seconds, s) : s;
    }
  } catch (const std::exception& e) {
    TORCH_WARN(name_, ": the host-to-device rate probe failed (", e.what(),
               "); the automatic plan counts uploads as free");
    seconds = 0;
  }
  return seconds > 0 ? bytes / seconds : 0;
}

}  // namespace roundpipe::detail

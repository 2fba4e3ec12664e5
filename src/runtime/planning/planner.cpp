// The automatic plan: try every stage workload W that some run of
// consecutive layers sums to; pack layers greedily under W and the memory
// limit (the fused tail and backward stages from the last layer down,
// forward stages from layer 0 up); keep the plans whose every stage fits
// with the next stage's parameters arriving; predict the call's time; keep
// the cheapest.
#include "roundpipe/planner.h"
#include "roundpipe/run_config.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <sstream>

namespace roundpipe {
namespace {

double gib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 30);
}

struct Costs {
  std::vector<double> forward, backward;  // per-layer compute of a forward / backward stage
};

// What a stage holds, grown one layer at a time. Its memory: parameters,
// and for backward stages their gradients and one microbatch's activations
// of every layer (stage-grain recompute) or of its largest layer (layer
// grain), in layer-from-stage grain with the rerun's inputs on the device
// also one microbatch's inputs of its layers but the last (their outputs
// but the last's stand for them); a forward stage keeps only the largest
// layer's activations alive; and on top, the largest working memory of
// one of its layers.
struct StageLoad {
  double compute = 0;
  int64_t params = 0, grads = 0, acts = 0, max_act = 0, max_working = 0;
  int64_t outputs = 0, last_output = 0;
  int last = -1;
  void add(const LayerCost& layer, double cost, int index) {
    compute += cost;
    params += layer.param_bytes;
    grads += layer.grad_bytes;
    acts += layer.activation_bytes;
    max_act = std::max(max_act, layer.activation_bytes);
    max_working = std::max(max_working, layer.working_bytes);
    outputs += layer.output_bytes;
    if (index > last) last = index, last_output = layer.output_bytes;
  }
  // `tail`: the fused tail, whose layers' inputs stay on the host.
  int64_t memory(bool backward, const PlanRequest& request, bool tail = false) const {
    if (!backward) return params + max_act + max_working;
    if (!request.layer_grain) return params + grads + acts + max_working;
    const bool inputs = request.rerun_from_stage_input && request.rerun_inputs_on_device && !tail;
    return params + grads + max_act + max_working + (inputs ? outputs - last_output : 0);
  }
  // Its memory while the next stage's parameters arrive, with its own
  // standing for theirs (packing does not know the next stage yet; the
  // packed plan is then checked with the real one).
  int64_t peak(bool backward, const PlanRequest& request, bool tail) const {
    return memory(backward, request, tail) + params;
  }
};

// The limit stages are packed under: half of it until the activations are
// measured.
int64_t effective_limit(const PlanRequest& request) {
  return request.activations_unmeasured
             ? static_cast<int64_t>(static_cast<double>(request.memory_limit_bytes) *
                                    (1 - request.unmeasured_activation_share))
             : request.memory_limit_bytes;
}

StageLoad stage_load(const std::vector<LayerCost>& layers, const LayerRange& r) {
  StageLoad load;
  for (int l = r.begin; l < r.end; ++l) load.add(layers[l], 0, l);
  return load;
}

// Stages of compute <= budget whose peak memory fits the limit, over layers [begin, end):
// ascending, or descending (deep to shallow) from end. A stage holds at
// least one layer.
std::vector<LayerRange> pack(const std::vector<LayerCost>& layers, const std::vector<double>& cost,
                             int begin, int end, double budget, const PlanRequest& request,
                             bool backward, bool descending) {
  const int64_t limit = effective_limit(request);
  std::vector<LayerRange> stages;
  StageLoad load;
  int edge = descending ? end : begin;  // where the open stage starts
  for (int i = 0; i < end - begin; ++i) {
    const int l = descending ? end - 1 - i : begin + i;
    StageLoad grown = load;
    grown.add(layers[l], cost[l], l);
    // (Backward stages are packed deep to shallow: the first is the tail.)
    const bool tail = backward && request.fused && stages.empty();
    const bool too_big =
        grown.compute > budget || (limit > 0 && grown.peak(backward, request, tail) > limit);
    if (l != (descending ? edge - 1 : edge) && too_big) {
      stages.push_back(descending ? LayerRange{l + 1, edge} : LayerRange{edge, l});
      edge = descending ? l + 1 : l;
      grown = StageLoad();
      grown.add(layers[l], cost[l], l);
    }
    load = grown;
  }
  const LayerRange last = descending ? LayerRange{begin, edge} : LayerRange{edge, end};
  if (last.size() > 0) stages.push_back(last);
  return stages;
}

StageEstimate estimate(const std::vector<LayerCost>& layers, const std::vector<double>& cost,
                       const LayerRange& r, bool backward, const PlanRequest& request,
                       bool tail = false) {
  StageEstimate s;
  s.range = r;
  s.backward = backward;
  for (int l = r.begin; l < r.end; ++l) s.compute += cost[l];
  const auto load = stage_load(layers, r);
  s.param_bytes = load.params;
  if (request.upload_bytes_per_second > 0) s.upload = load.params / request.upload_bytes_per_second;
  s.memory_bytes = load.memory(backward, request, tail);
  return s;
}

// The time per call of back-to-back calls on the round-robin schedule (a
// call starts while the one before still runs its last backward stages, so
// the steady state, not one call's fill and drain, is what training sees).
// Stages of consecutive calls take devices in turn (stage g of the sequence
// on device g mod D); a stage runs once its device is free, its parameters
// have arrived (their upload starts when the stage two before it on the
// device has finished: one stage runs while the next arrives), and
// microbatch 0 has left the stage before it in the same call; its last
// microbatch ends no earlier than the previous stage's last one plus its
// own time. A call is issued once the one before has returned: with the
// fused tail, when its losses are known (the tail stage has finished);
// otherwise when its backward is done (its last stage). Four calls are
// simulated; the time per call is the spacing of the last two.
double simulate(const std::vector<StageEstimate>& stages, const PlanRequest& request) {
  const size_t D = static_cast<size_t>(request.num_devices);
  const double M = request.num_microbatches;
  const size_t S = stages.size();
  const size_t forward_stages = static_cast<size_t>(
      std::count_if(stages.begin(), stages.end(), [](const auto& s) { return !s.backward; }));
  // The stage of a call whose end lets the next call be issued.
  const size_t returns_after = request.fused && forward_stages < S ? forward_stages : S - 1;
  constexpr size_t kCalls = 4;
  std::vector<double> start(S * kCalls), finish(S * kCalls);
  for (size_t g = 0; g < S * kCalls; ++g) {
    const auto& stage = stages[g % S];
    const size_t call = g / S;
    const double t = stage.compute;
    const double device_free = g >= D ? finish[g - D] : 0;
    const double upload_from = g >= 2 * D ? finish[g - 2 * D] : 0;
    const double issued = call > 0 ? finish[(call - 1) * S + returns_after] : 0;
    double begin = std::max({device_free, std::max(upload_from, issued) + stage.upload, issued});
    double end = begin + M * t;
    if (g % S > 0) {  // behind the stage before it in the same call
      begin = std::max(begin, start[g - 1] + stages[g % S - 1].compute);
      end = std::max(begin + M * t, finish[g - 1] + t);
    }
    start[g] = begin;
    finish[g] = end;
  }
  return finish[S * kCalls - 1] - finish[S * (kCalls - 1) - 1];
}

// The host bytes a backward stage (not the fused tail, whose inputs are
// its own stage's) keeps from the forward to its backward
// (CallState::make_slots): its layers' inputs in layer grain, else its
// own; none for layer 0 (the caller's input).
// `inputs`: how many layer inputs (a microbatch's) those are, which
// orders plans where output bytes are not measured yet.
int64_t checkpoint_bytes_of(const std::vector<LayerCost>& layers, const LayerRange& r,
                            const PlanRequest& request, int& inputs) {
  const bool every_layer = request.layer_grain && !request.rerun_from_stage_input;
  int64_t bytes = 0;
  for (int l = std::max(r.begin, 1); l < (every_layer ? r.end : r.begin + 1); ++l) {
    bytes += layers[l - 1].output_bytes;
    ++inputs;
  }
  return bytes * request.num_microbatches;
}

// Per-layer compute of a forward stage and of a backward stage.
Costs costs_of(const std::vector<LayerCost>& layers) {
  Costs c;
  for (const auto& layer : layers) {
    c.forward.push_back(std::max(layer.forward, 1e-12));
    c.backward.push_back(std::max(layer.recompute + layer.backward, 1e-12));
  }
  return c;
}

// A plan's predicted time for choosing between plans of different kinds.
// A pipeline over several devices is predicted without what a replicated
// tail does not have: activation hand-offs through host memory and the
// bubbles around them (on 2 x H200 the measured time per call was ~14%
// above the prediction, the replicated tail's within a few percent).
double comparable_time(const PlanEstimate& e, const PlanRequest& request) {
  constexpr double kPipelineOptimism = 1.15;
  const bool pipelined = e.plan.tail_replicas == 1 && request.num_devices > 1;
  return pipelined ? e.iteration * kPipelineOptimism : e.iteration;
}

}  // namespace

std::vector<LayerCost> costs_from_bytes(const std::vector<int64_t>& layer_bytes,
                                        const std::vector<int64_t>& layer_grad_bytes) {
  TORCH_CHECK(layer_bytes.size() == layer_grad_bytes.size(),
              "costs_from_bytes: one gradient size per layer");
  std::vector<LayerCost> costs;
  for (size_t l = 0; l < layer_bytes.size(); ++l) {
    const double t = static_cast<double>(std::max<int64_t>(layer_bytes[l], 1));
    costs.push_back({t, t, 2 * t, layer_bytes[l], layer_grad_bytes[l], 0});
  }
  return costs;
}

// The time per call of a plan's estimated stages.
double iteration_of(const PlanEstimate& e, const PlanRequest& request) {
  if (e.plan.tail_replicas > 1) {
    // Each replica uploads the model (links in parallel) and runs its share
    // of the microbatches; the next call comes once the losses are back.
    const auto& s = e.stages.front();
    const int share = (request.num_microbatches + e.plan.tail_replicas - 1) / e.plan.tail_replicas;
    return s.upload + share * s.compute;
  }
  return simulate(e.stages, request);
}

// Note [Tail grain]
// In layer grain the fused tail runs its layers without grad, keeping their
// inputs, then its last layer and the loss with grad, then recomputes the
// others one at a time: one extra forward of every layer but the last. A
// tail in stage grain runs them all with grad once, but holds all of their
// activations. Between the two, the tail runs its last k layers with grad
// (their activations kept, no recompute) and recomputes the rest by layer:
// k is the most the limit holds with everything else the stage holds (its
// parameters, gradients, the largest working memory, the next stage's
// parameters). Their backward adds to the gradients in place (running out
// of memory there, after an earlier microbatch left gradients, redoes the
// call: Note [Out-of-memory retry of a microbatch]). Where its layers split
// their input by rows and the
// loss adds up over rows (Note [Tail row chunks], layer.h), the tail may
// also run each microbatch in c chunks of rows, holding one chunk's
// activations at a time: the fewest chunks that keep every layer's
// activations, else as many as there are rows. A chunk keeps its rows'
// share of a layer's activations, but whole what the layer keeps whatever
// its rows (LayerCost::activation_bytes_independent_of_rows): the CUDA
// fused loss makes the output weight's float32 gradient in its forward and
// keeps it, 1.16-1.47 GiB at the presets' vocabularies. Counted by the
// chunk's share, 3/4 of it was missed in four chunks (0.87-1.10 GiB): on
// one H100 (a584039, the consumer harness) every workload's peak allocated
// memory came 0.95-1.19 GiB above the plan's prediction, and Qwen3-4B at
// 12 GiB ran out of memory once. And the input gradients of a
// microbatch's earlier chunks stay on the device until its last chunk is
// done: 48-72 MiB for the presets' 4 x 4,096-token microbatches in four
// chunks, about the 0.08 GiB d6e4d3b's runs still missed; counted, the
// prediction came within 0.03 GiB of the allocated peak (one H100, 6f45804,
// bench/README.md). On a 24 GiB card a 1.7B
// model's 29-layer tail over 16K-token microbatches keeps about a dozen
// layers' activations in one chunk, all of them in two or four. The extra
// forward of the layers recomputed is added to the tail's predicted time,
// in every candidate plan_stages weighs, not only in the one it picks:
// priced as if its tail kept every layer, a long tail looked one forward
// per layer cheaper than the stages it replaced, while each layer it
// cannot keep costs that forward all the same. A layer outside the tail
// costs a forward, a recompute and a backward; so does one the tail cannot
// keep; one it keeps saves the forward. And every layer in the tail holds
// its parameters and gradients there, so the fastest tail is about as long
// as it can keep. (The Llama-3.2-3B shape at 24 GiB: its tail was layers
// 5..29 keeping the last 10, 20 of its 28 layers recomputed in all.)
PlanEstimate with_tail_grown(const std::vector<LayerCost>& layers, PlanEstimate e,
                             const PlanRequest& request) {
  const int64_t limit = effective_limit(request);
  if (!request.fused || !request.layer_grain || !request.grow_tail_with_grad ||
      request.activations_unmeasured || limit == 0)
    return e;
  auto& tail = e.stages.at(e.plan.forward.size());  // backward[0]
  const auto load = stage_load(layers, tail.range);
  // All the tail holds but the one layer's activations of layer grain.
  const int64_t rest = tail.peak_bytes - load.max_act;
  // Chunks: at most the smallest microbatch's rows, so that every
  // microbatch runs in as many; their bytes: the largest microbatch's.
  const int rows = std::max(request.tail_rows, 1);
  const int largest = std::max(request.tail_rows_largest, rows);
  const int max_chunks = tail.range.begin >= request.first_row_split_layer ? rows : 1;
  // The tail's input (its gradient goes back to the stage before it).
  const int64_t input_bytes = tail.range.begin > 0 ? layers[tail.range.begin - 1].output_bytes : 0;
  int best_k = 0, best_chunks = 1;
  int64_t best_held = 0;
  for (int chunks = 1; chunks <= max_chunks; ++chunks) {
    // A chunk's share of a microbatch's activations: its rows (the first
    // chunks take the extra rows).
    const double share = static_cast<double>((largest + chunks - 1) / chunks) / largest;
    auto part = [&](const LayerCost& layer) {
      // (At most all it keeps: LayerCost is the caller's to fill.)
      const int64_t fixed = std::clamp<int64_t>(layer.activation_bytes_independent_of_rows, 0,
                                                layer.activation_bytes);
      return static_cast<int64_t>(std::ceil((layer.activation_bytes - fixed) * share)) + fixed;
    };
    int64_t one_layer = 0;
    for (int l = tail.range.begin; l < tail.range.end; ++l)
      one_layer = std::max(one_layer, part(layers[l]));
    // The input gradients of the chunks before the last stay on the device
    // until it is done (StageRun::run_tail_in_chunks merges them): all
    // rows' but the last chunk's, the smallest (the most of them in the
    // largest microbatch).
    const int64_t earlier_grads =
        chunks > 1 ? input_bytes - input_bytes * (largest / chunks) / largest : 0;
    int64_t kept = 0;
    int k = 0;
    for (int l = tail.range.end - 1; l >= tail.range.begin; --l) {
      const int64_t grown = kept + part(layers[l]);
      if (k > 0 && rest + std::max(grown, one_layer) + earlier_grads > limit) break;
      kept = grown;
      ++k;
    }
    if (k > best_k) {
      best_k = k;
      best_chunks = chunks;
      best_held = std::max(kept, one_layer) + earlier_grads - load.max_act;
    }
    if (k == tail.range.size()) break;
  }
  tail.layers_with_grad = best_k;
  tail.row_chunks = best_chunks;
  tail.memory_bytes += best_held;
  tail.peak_bytes += best_held;
  for (int l = tail.range.begin; l < tail.range.end - best_k; ++l)
    tail.compute += std::max(layers[l].forward, 0.0);  // the extra forward
  e.iteration = iteration_of(e, request);
  return e;
}

namespace {
int64_t largest_param_bytes(const std::vector<LayerCost>& layers) {
  int64_t largest = 0;
  for (const auto& layer : layers) largest = std::max(largest, layer.param_bytes);
  return largest;
}
}  // namespace

int64_t smallest_feasible_memory_limit(const std::vector<LayerCost>& layers,
                                       const PlanRequest& request) {
  // One layer per stage fits once the limit holds the largest one-layer
  // backward stage and the largest layer's parameters.
  int64_t worst_memory = 0;
  for (int l = 0; l < static_cast<int>(layers.size()); ++l)
    worst_memory = std::max(worst_memory, stage_load(layers, {l, l + 1}).memory(true, request));
  const int64_t limit = worst_memory + largest_param_bytes(layers);
  return request.activations_unmeasured
             ? static_cast<int64_t>(std::ceil(static_cast<double>(limit) /
                                              (1 - request.unmeasured_activation_share)))
             : limit;
}

namespace {
// Whether `candidate` is a better plan than `best` (`faster`: by time):
// by time, but in layer-from-stage grain the host's checkpoints first
// (PlanRequest::host_checkpoint_limit_bytes).
bool host_order(const PlanEstimate& candidate, const PlanEstimate& best, bool faster,
                const PlanRequest& request) {
  if (!request.rerun_from_stage_input) return faster;
  const int64_t limit = request.host_checkpoint_limit_bytes;
  // (Equal bytes, as before output bytes are measured: fewer inputs.)
  const auto fewer = candidate.checkpoint_bytes < best.checkpoint_bytes ||
                     (candidate.checkpoint_bytes == best.checkpoint_bytes &&
                      candidate.checkpoint_inputs < best.checkpoint_inputs);
  const auto same = candidate.checkpoint_bytes == best.checkpoint_bytes &&
                    candidate.checkpoint_inputs == best.checkpoint_inputs;
  if (limit <= 0) return fewer || (same && faster);
  const bool candidate_fits = candidate.checkpoint_bytes <= limit;
  const bool best_fits = best.checkpoint_bytes <= limit;
  if (candidate_fits != best_fits) return candidate_fits;
  return candidate_fits ? faster : fewer || (same && faster);
}
}  // namespace

PlanEstimate plan_stages(const std::vector<LayerCost>& layers, const PlanRequest& request) {
  const int L = static_cast<int>(layers.size());
  TORCH_CHECK(L >= 1, "a RoundPipe model needs at least one layer");
  TORCH_CHECK(request.num_devices >= 1 && request.num_microbatches >= 1,
              "plan_stages: needs at least one device and one microbatch");
  const auto c = costs_of(layers);
  // A plan fits when every stage, while it runs, fits the limit together
  // with the parameters of the stage that arrives meanwhile on its device
  // (StageEstimate::peak_bytes, from estimate_plan).
  const int64_t limit = effective_limit(request);
  const auto plan_fits = [&](const PlanEstimate& e) {
    return limit == 0 || std::all_of(e.stages.begin(), e.stages.end(),
                                     [&](const StageEstimate& s) { return s.peak_bytes <= limit; });
  };
  // For the error where even one layer per stage does not fit.
  int worst = 0;
  int64_t worst_memory = 0;
  for (int l = 0; l < L; ++l) {
    const int64_t m = stage_load(layers, {l, l + 1}).memory(true, request);
    if (m > worst_memory) worst = l, worst_memory = m;
  }
  bool any_fits = false, any_staged = false;
  std::set<double> budgets;
  for (const auto* cost : {&c.forward, &c.backward}) {
    for (int i = 0; i < L; ++i) {
      double sum = 0;
      for (int j = i; j < L; ++j) budgets.insert(sum += (*cost)[j]);
    }
  }
  PlanEstimate best;
  best.iteration = std::numeric_limits<double>::infinity();
  size_t best_stages = 0;
  for (double budget : budgets) {
    ExecutePlan plan;
    plan.backward = pack(layers, c.backward, 0, L, budget, request, true, true);
    const int forward_end = request.fused ? plan.backward.front().begin : L;
    plan.forward = pack(layers, c.forward, 0, forward_end, budget, request, false, false);
    const size_t stages = plan.forward.size() + plan.backward.size();
    if (static_cast<int>(stages) < request.min_stages) continue;
    any_staged = true;
    auto candidate = estimate_plan(layers, plan, request);
    if (!plan_fits(candidate)) continue;
    // Priced with the forwards its tail still recomputes (Note [Tail
    // grain]): a long tail that keeps few layers is slower than it looks.
    candidate = with_tail_grown(layers, std::move(candidate), request);
    const bool faster =
        candidate.iteration < best.iteration * (1 - 1e-9) ||
        (candidate.iteration <= best.iteration * (1 + 1e-9) && stages < best_stages);
    if (!any_fits || host_order(candidate, best, faster, request)) {
      best = std::move(candidate);
      best_stages = stages;
    }
    any_fits = true;
  }
  // The whole model as one fused stage on several devices at once, each
  // with its share of the microbatches: no recompute and no pipeline
  // bubbles, where the whole model fits one device's stage budget.
  const int replicas = std::min(request.num_devices, request.num_microbatches);
  if (request.fused && request.allow_tail_replicas && replicas > 1 && request.min_stages <= 1) {
    ExecutePlan plan;
    plan.backward = {{0, L}};
    plan.tail_replicas = replicas;
    auto candidate = estimate_plan(layers, plan, request);
    const bool fits = plan_fits(candidate);
    candidate = with_tail_grown(layers, std::move(candidate), request);
    if (fits && comparable_time(candidate, request) < comparable_time(best, request)) {
      best = std::move(candidate);
      any_fits = true;
    }
  }
  TORCH_CHECK(any_staged, "no plan has at least min_stages = ", request.min_stages,
              " stages for a model of ", L, " layers");
  TORCH_CHECK(
      limit == 0 || any_fits, "model_memory_limit ", gib(request.memory_limit_bytes),
      request.activations_unmeasured
          ? " GiB (" + std::to_string(static_cast<int>(request.unmeasured_activation_share * 100)) +
                "% of it kept for activations, not measured yet)"
          : std::string(" GiB"),
      " is too small: layer ", worst, " alone needs ", gib(worst_memory),
      " GiB in a backward stage (parameters ", gib(layers[worst].param_bytes), ", gradients ",
      gib(layers[worst].grad_bytes), ", activations ", gib(layers[worst].activation_bytes),
      " GiB), and another stage's parameters (up to ", gib(largest_param_bytes(layers)),
      " GiB) arrive while it runs: the smallest feasible limit is at most ",
      gib(smallest_feasible_memory_limit(layers, request)),
      " GiB (one layer per stage). Raise model_memory_limit, or cut activations with "
      "more microbatches or recompute_grain=\"layer\", or split that layer.");
  // Keep the plan in use unless the new one is clearly faster: measured
  // times wobble from call to call, and a plan that flips every call costs
  // more than the percent it may win.
  if (request.incumbent != nullptr &&
      (request.incumbent->tail_replicas == 1 || request.allow_tail_replicas)) {
    auto kept = estimate_plan(layers, *request.incumbent, request);
    const bool kept_fits = plan_fits(kept);
    kept = with_tail_grown(layers, std::move(kept), request);
    const bool valid = static_cast<int>(kept.stages.size()) >= request.min_stages;
    // (In layer-from-stage grain, not where the new plan keeps fewer
    // checkpoints than the host has room for.)
    const bool host_ok = !host_order(best, kept, /*faster=*/false, request);
    if (kept_fits && valid && host_ok &&
        comparable_time(kept, request) <=
            comparable_time(best, request) * (1 + request.keep_within))
      return kept;
  }
  return best;
}

PlanEstimate estimate_plan(const std::vector<LayerCost>& layers, const ExecutePlan& plan,
                           const PlanRequest& request) {
  PlanEstimate e;
  e.plan = plan;
  const auto c = costs_of(layers);
  for (const auto& r : plan.forward)
    e.stages.push_back(estimate(layers, c.forward, r, false, request));
  e.rerun_inputs_on_device = request.rerun_from_stage_input && request.rerun_inputs_on_device;
  for (size_t i = 0; i < plan.backward.size(); ++i) {
    const auto& r = plan.backward[i];
    const bool tail = request.fused && i == 0;
    e.stages.push_back(estimate(layers, c.backward, r, true, request, tail));
    if (tail) continue;  // the tail: with_tail_grown counts its extra forward
    e.checkpoint_bytes += checkpoint_bytes_of(layers, r, request, e.checkpoint_inputs);
    // Rerun from the stage's input: all but its last layer once more.
    if (request.rerun_from_stage_input)
      for (int l = r.begin; l < r.end - 1; ++l) e.stages.back().compute += c.forward[l];
  }
  // While a stage runs, the stage arriving next on its device is the one D
  // later in the cyclic order of stages (a replicated tail: the same stage,
  // for the next call).
  const size_t S = e.stages.size();
  const size_t D = plan.tail_replicas > 1 ? 1 : static_cast<size_t>(request.num_devices);
  for (size_t g = 0; g < S; ++g)
    e.stages[g].peak_bytes = e.stages[g].memory_bytes + e.stages[(g + D) % S].param_bytes;
  e.iteration = iteration_of(e, request);
  return e;
}

int64_t PlanEstimate::largest_peak_bytes() const {
  int64_t peak = 0;
  for (const auto& s : stages) peak = std::max(peak, s.peak_bytes);
  return peak;
}

std::string PlanEstimate::describe() const {
  std::ostringstream out;
  char line[200];
  for (const auto& s : stages) {
    std::snprintf(
        line, sizeof(line),
        "  %-9s layers [%d, %d)  compute %.4g per microbatch  upload %.4g  memory %.3f GiB"
        "  (%.3f GiB with the next stage's parameters)\n",
        s.backward ? "backward" : "forward", s.range.begin, s.range.end, s.compute, s.upload,
        gib(s.memory_bytes), gib(s.peak_bytes));
    out << line;
    if (s.layers_with_grad > 0)
      out << "            its last " << s.layers_with_grad
          << " layer(s) with grad, the rest recomputed by layer (Note [Tail grain])"
          << (s.row_chunks > 1
                  ? ", each microbatch in " + std::to_string(s.row_chunks) + " chunks of rows"
                  : std::string())
          << "\n";
  }
  out << "  plan " << plan.to_string() << ", predicted " << iteration << " per call";
  if (checkpoint_bytes > 0)
    out << ", " << gib(checkpoint_bytes) << " GiB of checkpoints on the host";
  if (rerun_inputs_on_device)
    out << " (the backward stages' reruns keep their inputs on the device)";
  return out.str();
}

// The default plan of ExecutePlan (execute_plan.h) is the planner's: the
// automatic plan on byte costs, without a memory limit or upload rate.
ExecutePlan ExecutePlan::from_layer_costs(const std::vector<int64_t>& layer_bytes, int num_devices,
                                          bool fused) {
  PlanRequest request;
  request.num_devices = num_devices;
  request.fused = fused;
  request.num_microbatches = default_num_microbatch(num_devices);
  return plan_stages(costs_from_bytes(layer_bytes, layer_bytes), request).plan;
}

}  // namespace roundpipe

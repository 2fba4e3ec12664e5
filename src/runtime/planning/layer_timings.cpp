#include "runtime/planning/layer_timings.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace roundpipe::detail {
namespace {
constexpr double kRate = 0.9;

// Keeps in (`bytes`, `at`) the sample with the most bytes per output byte.
void keep_most_per_output_byte(int64_t& bytes, int64_t& at, int64_t sample, int64_t output) {
  const auto ratio = [](int64_t b, int64_t o) {
    return o > 0 ? static_cast<double>(b) / static_cast<double>(o) : 0.0;
  };
  if (ratio(sample, output) <= ratio(bytes, at)) return;
  bytes = sample;
  at = output;
}
}  // namespace

double LayerTimings::Smoothed::value() const {
  const int n = samples - 1;  // the first sample was dropped
  return n > 0 ? average / (1 - std::pow(kRate, n)) : 0;
}

LayerTimings::LayerTimings(int num_layers, bool verbose)
    : verbose_(verbose),
      times_(3 * num_layers),
      output_bytes_(num_layers),
      kept_per_output_byte_(num_layers),
      kept_samples_(num_layers),
      kept_independent_of_rows_(num_layers),
      working_sample_bytes_(num_layers),
      working_sample_output_(num_layers),
      backward_samples_(num_layers),
      kept_recorded_(num_layers),
      backward_recorded_(num_layers),
      first_backward_bytes_(num_layers),
      first_backward_output_(num_layers),
      first_backward_samples_(num_layers),
      first_backward_recorded_(num_layers) {}

void LayerTimings::add(int layer, Kind kind, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& t = times_.at(3 * layer + kind);
  if (t.samples++ == 0) return;  // warm-up: allocator, kernels, caches
  t.average = kRate * t.average + (1 - kRate) * seconds;
  if (verbose_) {
    static const char* const kNames[] = {"fwd", "re", "bwd"};
    std::fprintf(stderr, "Layer %d %s  new record: %.3f ms  new estimate: %.3f ms\n", layer,
                 kNames[kind], seconds * 1e3, t.value() * 1e3);
  }
}

void LayerTimings::add_output_bytes(int layer, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  output_bytes_.at(layer) = std::max(output_bytes_.at(layer), bytes);
}

bool LayerTimings::wants_kept_bytes(int layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_samples_.at(layer) < kKeptSamples;
}

void LayerTimings::add_kept_bytes(int layer, int64_t kept, int64_t peak, int64_t output,
                                  int64_t independent_of_rows) {
  std::lock_guard<std::mutex> lock(mu_);
  if (kept_samples_.at(layer)++ == 0 || output <= 0) return;
  ++kept_recorded_.at(layer);
  independent_of_rows = std::clamp<int64_t>(independent_of_rows, 0, std::max<int64_t>(kept, 0));
  auto& fixed = kept_independent_of_rows_.at(layer);
  fixed = std::max(fixed, independent_of_rows);
  auto& ratio = kept_per_output_byte_.at(layer);
  ratio = std::max(ratio,
                   static_cast<double>(kept - independent_of_rows) / static_cast<double>(output));
  add_working(layer, peak - kept, output);
}

void LayerTimings::add_working(int layer, int64_t bytes, int64_t output) {
  keep_most_per_output_byte(working_sample_bytes_.at(layer), working_sample_output_[layer], bytes,
                            output);
}

bool LayerTimings::wants_backward_bytes(int layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return backward_samples_.at(layer) < kKeptSamples;
}

// Note [Backward working memory]
// A layer's backward holds more than its forward kept: a 32B decoder
// layer's SwiGLU backward allocates both input gradients (2 x 1.56 GiB over
// a 32,768-token microbatch) beside what it saved, about 3 GiB beyond the
// start of the backward against ~1 GiB of the forward's working memory.
// The first backward of a layer with trainable parameters is not metered
// (it allocates their gradients, which the plan counts apart), and the
// first metered sample used to be dropped as a warm-up too: with two
// microbatches a call, the first call then measured no backward at all, and
// the second call's plan (the first measured one) counted the forward's
// working memory only. At 32B its backward stages ran out of memory by
// ~3 GiB in every grain with several layers a stage (H100, 2026-12-05:
// the allocator's census at the error showed the layer's saved MLP blocks,
// the SwiGLU output's gradient and one of its input gradients, 1.56 GiB
// each, the other being asked for). So a metered backward that follows an
// unmetered one counts, and the plan counts activations as measured only
// once every layer's backward working memory is (memory_measured()).
void LayerTimings::add_backward_bytes(int layer, int64_t peak, bool after_a_first_backward) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t output = output_bytes_.at(layer);
  const bool first = backward_samples_.at(layer)++ == 0;
  if ((first && !after_a_first_backward) || output <= 0) return;
  ++backward_recorded_.at(layer);
  add_working(layer, peak, output);
}

// Note [One microbatch a call]
// A call of one microbatch (one long row: 1 x 65,536 tokens) runs every
// layer's backward on parameters without gradients, so none is metered
// (Note [Backward working memory]): such calls never count the activations
// as measured, and their plans pack the stages into a quarter or half of
// the limit (Note [First training call]) for good. That holds room for
// what the stage memory leaves out there (the backward's working memory,
// and the incoming gradient and input of a whole long row: Qwen3-1.7B over
// 1 x 65,536 tokens allocated 9.82 GiB on an H200 against the 7.61 GiB its
// stages were estimated at). But where no plan holds half back, the call
// failed as "too small" although it fit: a 6-layer Qwen3-shaped model over
// 1 x 4,096 tokens on a simulated device of 80 MiB, which trains in 52 MB.
// So those backwards are metered too (after the first, a warm-up): one
// that allocates the gradients holds about what a later one does (which
// adds a new gradient into the old), and its peak with the gradient it
// received and its input stands for the working memory. Plans use it only
// where no plan holds half the limit back (AutoPlan::estimate); every
// other plan is as before, and so are the costs of calls of two or more
// microbatches, which measure a later backward in their first call. (Its
// chunks of rows keep their share of what the whole microbatch measured:
// Note [Tail row chunks of a token-chunked layer].)
bool LayerTimings::wants_first_backward_bytes(int layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return backward_recorded_.at(layer) == 0 && first_backward_samples_.at(layer) < kKeptSamples;
}

void LayerTimings::add_first_backward_bytes(int layer, int64_t peak, int64_t incoming_grad) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t output = output_bytes_.at(layer);
  if (first_backward_samples_.at(layer)++ == 0 || output <= 0) return;
  ++first_backward_recorded_.at(layer);
  const int64_t input = layer > 0 ? output_bytes_[layer - 1] : 0;
  keep_most_per_output_byte(first_backward_bytes_[layer], first_backward_output_[layer],
                            peak + incoming_grad + input, output);
}

int64_t LayerTimings::kept_bytes(size_t layer) const {
  return std::max(output_bytes_[layer],
                  static_cast<int64_t>(kept_per_output_byte_[layer] * output_bytes_[layer]) +
                      kept_independent_of_rows_[layer]);
}

// Note [Working memory that does not follow the rows]
// A layer's backward allocates its parameters' gradient before adding it
// to the accumulated one: as many bytes whatever the rows. Measured on a
// short first call and scaled with the output as a whole, that part grew
// with a longer call's rows: a Linear(160, 160)'s backward over 3 rows held
// its 100 KB weight gradient beside 2 KB that follow the rows, 64 times the
// rows were estimated at about 6.5 MB, and the planner found no stage that
// fit a 2.4 MB budget, in which the longer call then peaked at 1.0 MB
// (AutomaticPlanUnderABudget.ALongerCallAfterShortOnesTrainsWithinTheBudget).
// So up to one gradient of the layer's parameters of the measured working
// memory stays whole and only the rest scales. At the measured size the
// estimate is the measurement, so calls of one size plan as before.
int64_t LayerTimings::working_bytes(size_t layer, int64_t grad_bytes,
                                    bool first_backwards_stand_in) const {
  const int64_t measured = scaled_working(layer, working_sample_bytes_[layer],
                                          working_sample_output_[layer], grad_bytes);
  if (!first_backwards_stand_in || backward_recorded_[layer] > 0) return measured;
  return std::max(measured, scaled_working(layer, first_backward_bytes_[layer],
                                           first_backward_output_[layer], grad_bytes));
}

int64_t LayerTimings::scaled_working(size_t layer, int64_t bytes, int64_t output,
                                     int64_t grad_bytes) const {
  if (output <= 0) return 0;
  const double measured = static_cast<double>(bytes);
  const double fixed = std::min(measured, static_cast<double>(std::max<int64_t>(grad_bytes, 0)));
  return static_cast<int64_t>(fixed + (measured - fixed) *
                                          static_cast<double>(output_bytes_[layer]) /
                                          static_cast<double>(output));
}

bool LayerTimings::complete() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t l = 0; l < output_bytes_.size(); ++l) {
    // A layer of the fused tail only ever runs forward with grad: its
    // recompute time stands for its forward time, and the other way round.
    const bool forward =
        times_[3 * l + kForward].samples >= 2 || times_[3 * l + kRecompute].samples >= 2;
    if (!forward || times_[3 * l + kBackward].samples < 2) return false;
  }
  return true;
}

bool LayerTimings::memory_measured(bool first_backwards_stand_in) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t l = 0; l < output_bytes_.size(); ++l)
    if (kept_recorded_[l] == 0 || (backward_recorded_[l] == 0 &&
                                   (!first_backwards_stand_in || first_backward_recorded_[l] == 0)))
      return false;
  return true;
}

std::vector<LayerCost> LayerTimings::costs(const std::vector<int64_t>& param_bytes,
                                           const std::vector<int64_t>& grad_bytes,
                                           bool first_backwards_stand_in) const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t L = output_bytes_.size();
  TORCH_CHECK(param_bytes.size() == L && grad_bytes.size() == L,
              "LayerTimings: one size per layer");
  std::vector<LayerCost> costs(L);
  for (size_t l = 0; l < L; ++l) {
    const double forward = times_[3 * l + kForward].value();
    const double recompute = times_[3 * l + kRecompute].value();
    costs[l].forward = forward > 0 ? forward : recompute;
    costs[l].recompute = recompute > 0 ? recompute : forward;
    costs[l].backward = times_[3 * l + kBackward].value();
    costs[l].param_bytes = param_bytes[l];
    costs[l].grad_bytes = grad_bytes[l];
    costs[l].output_bytes = output_bytes_[l];
    // What a backward stage keeps per layer and microbatch: what the
    // layer's forward with grad was measured to keep, at least its output.
    costs[l].activation_bytes = kept_bytes(l);
    costs[l].activation_bytes_independent_of_rows = kept_independent_of_rows_[l];
    costs[l].working_bytes = working_bytes(l, grad_bytes[l], first_backwards_stand_in);
  }
  return costs;
}

std::string LayerTimings::describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream out;
  char line[200];
  for (size_t l = 0; l < output_bytes_.size(); ++l) {
    std::snprintf(line, sizeof(line),
                  "  layer %3zu  forward %8.3f ms  recompute %8.3f ms  backward %8.3f ms  "
                  "output %.2f MiB  kept for backward %.2f MiB\n",
                  l, 1e3 * times_[3 * l].value(), 1e3 * times_[3 * l + 1].value(),
                  1e3 * times_[3 * l + 2].value(), output_bytes_[l] / 1048576.0,
                  kept_bytes(l) / 1048576.0);
    out << line;
  }
  return out.str();
}

}  // namespace roundpipe::detail

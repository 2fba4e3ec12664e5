// Per-layer compute times measured with device timing marks, smoothed for
// the automatic plan (REFERENCE.md section 5: rate 0.9 with bias
// correction, the first sample of each dropped as warm-up). Internal header.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "roundpipe/planner.h"

namespace roundpipe::detail {

class LayerTimings {
 public:
  enum Kind { kForward = 0, kRecompute = 1, kBackward = 2 };

  // verbose: each measurement prints the original's timing line to stderr
  // (ModelTimer.VERBOSE): "Layer N fwd|re|bwd  new record: X ms  new
  // estimate: Y ms".
  explicit LayerTimings(int num_layers, bool verbose = false);
  // One measurement (seconds, one microbatch). Thread-safe.
  void add(int layer, Kind kind, double seconds);
  // The bytes of a layer's output for one microbatch (largest seen).
  void add_output_bytes(int layer, int64_t bytes);
  // The bytes a layer's forward with grad keeps until its backward (its
  // saved activations and output), measured on a few forwards
  // (kKeptSamples, the first dropped: it also holds one-off workspaces),
  // as a multiple of that forward's output bytes: the estimate follows the
  // largest output seen (longer sequences keep more).
  static constexpr int kKeptSamples = 3;
  bool wants_kept_bytes(int layer) const;
  // `peak`: the most the forward held on the way; `independent_of_rows`:
  // the part of `kept` the layer said does not follow its rows
  // (note_kept_bytes_independent_of_rows), kept whole, not as a multiple.
  void add_kept_bytes(int layer, int64_t kept, int64_t peak, int64_t output,
                      int64_t independent_of_rows = 0);
  // Working bytes: the most a layer's forward with grad held beyond what it
  // keeps, or its backward beyond what it started with (temporaries, the
  // loss's logit chunks, gradients on their way to the parameters),
  // measured and scaled as kept bytes are, but for up to one gradient of
  // the layer's parameters, which does not follow the rows (Note [Working
  // memory that does not follow the rows]). The planner adds a stage's
  // largest to what the stage holds.
  // `after_a_first_backward`: the layer ran a backward before, unmetered
  // (its parameters' gradients were allocated there, with the one-off
  // workspaces), so this sample counts; else the first is dropped.
  bool wants_backward_bytes(int layer) const;
  void add_backward_bytes(int layer, int64_t peak, bool after_a_first_backward);
  // A backward that allocated the layer's parameters' gradients (the first
  // of a stage's microbatches): the only kind a call of one microbatch
  // runs. Its peak, with the gradient it received (`incoming_grad`) and its
  // input, stands for the backward's working memory until a backward after
  // one is measured (Note [One microbatch a call]); the first is dropped as
  // a warm-up.
  bool wants_first_backward_bytes(int layer) const;
  void add_first_backward_bytes(int layer, int64_t peak, int64_t incoming_grad);
  // Whether every layer has a smoothed time of every kind.
  bool complete() const;
  // Whether every layer has what it keeps and its backward's working memory
  // measured (Note [Backward working memory]): until then the plan holds
  // back part of the limit for them.
  // `first_backwards_stand_in`: a backward that allocated the gradients
  // stands for one after it (Note [One microbatch a call]).
  bool memory_measured(bool first_backwards_stand_in = false) const;
  // Measured costs (call when complete()).
  std::vector<LayerCost> costs(const std::vector<int64_t>& param_bytes,
                               const std::vector<int64_t>& grad_bytes,
                               bool first_backwards_stand_in = false) const;
  // One line per layer: forward / recompute / backward milliseconds.
  std::string describe() const;

 private:
  int64_t kept_bytes(size_t layer) const;  // (mu_ held)
  int64_t working_bytes(size_t layer, int64_t grad_bytes,
                        bool first_backwards_stand_in) const;  // (mu_ held)
  // A working-memory sample scaled to the layer's largest output.
  int64_t scaled_working(size_t layer, int64_t bytes, int64_t output,
                         int64_t grad_bytes) const;            // (mu_ held)
  void add_working(int layer, int64_t bytes, int64_t output);  // (mu_ held)
  struct Smoothed {
    int samples = 0;  // including the dropped first one
    double average = 0;
    double value() const;
  };
  bool verbose_ = false;
  mutable std::mutex mu_;
  std::vector<Smoothed> times_;  // [layer * 3 + kind]
  std::vector<int64_t> output_bytes_;
  std::vector<double> kept_per_output_byte_;
  std::vector<int> kept_samples_;
  std::vector<int64_t> kept_independent_of_rows_;
  // The working-memory sample with the most bytes per output byte: its
  // bytes and its output's.
  std::vector<int64_t> working_sample_bytes_, working_sample_output_;
  std::vector<int> backward_samples_;
  std::vector<int> kept_recorded_, backward_recorded_;  // samples that counted
  // The first backwards' sample with the most bytes per output byte, and
  // how many of them ran (the first dropped) and counted.
  std::vector<int64_t> first_backward_bytes_, first_backward_output_;
  std::vector<int> first_backward_samples_, first_backward_recorded_;
};

}  // namespace roundpipe::detail

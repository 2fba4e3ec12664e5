// metrics.jsonl, the one JSON line per step that roundpipe-train and the
// Python roundpipe.train write (and `python -m roundpipe.plot` draws):
// a step's line holds its loss, tokens and speed, and waits for its
// gradient norm (known once the step's update has run on the optimizer
// thread: for an asynchronous step, during the next one), so lines go out
// in step order as their updates finish. Evaluations get lines of their
// own ({"step", "eval_loss", "eval_perplexity"}) after their step's.
#pragma once

#include <cstdint>
#include <deque>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace roundpipe::train {

class MetricsLog {
 public:
  // What an update adds to its step's line: the gradient norm before
  // clipping (null in the JSON when not finite: a step the scaler
  // skipped), and where given, the learning rate and the loss (data
  // parallel: the mean over the processes, known on the optimizer thread).
  struct Update {
    double grad_norm = 0;
    std::optional<double> lr, loss;
  };

  // Writes `path` (empty: nothing, as on every process but rank 0). A run
  // resumed after `first_step` steps keeps the file's lines up to that
  // step and writes the rest again; otherwise the file starts empty.
  explicit MetricsLog(const std::string& path, int64_t first_step = 0);

  // A step's line: a JSON object with "step" (1-based) and "loss".
  void add_step(const std::string& json_object);
  void add_eval(int64_t step, double loss);

  // Writes the waiting lines in order while their updates are known: the
  // line of step s takes updates[s - 1 - first_step]. With `final`, the
  // rest are written without (the run ended before their updates).
  // Returns the lines written, for other sinks (TensorBoard).
  std::vector<std::string> write_known(const std::vector<Update>& updates, bool final = false);

 private:
  std::ofstream file_;
  int64_t first_step_ = 0;
  std::deque<std::string> waiting_;  // JSON objects, in step order
};

}  // namespace roundpipe::train

// PipelineStats (roundpipe/options.h) as the engine's threads add to them.
// Internal header.
#pragma once

#include <chrono>
#include <mutex>

#include "roundpipe/options.h"

namespace roundpipe::detail {

class StatsRecorder {
 public:
  using Clock = std::chrono::steady_clock;
  // Adds `seconds` to one of the fields.
  void add(double PipelineStats::*field, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.*field += seconds;
  }
  // Adds the seconds since `start`.
  void add_since(double PipelineStats::*field, Clock::time_point start) {
    add(field, std::chrono::duration<double>(Clock::now() - start).count());
  }
  // Adds one to a count.
  void count(int64_t PipelineStats::*field) {
    std::lock_guard<std::mutex> lock(mu_);
    ++(stats_.*field);
  }
  void count_update() { count(&PipelineStats::optimizer_updates); }
  // Sets a field that describes the latest call.
  void set(int64_t PipelineStats::*field, int64_t value) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.*field = value;
  }
  PipelineStats snapshot() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  mutable std::mutex mu_;
  PipelineStats stats_;
};

}  // namespace roundpipe::detail

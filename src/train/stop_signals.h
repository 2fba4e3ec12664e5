// roundpipe-train's stop signals: SIGINT or SIGTERM during a run stops it
// after the step in flight (a training checkpoint saved), a second one at
// once.
#pragma once

#include <signal.h>

namespace roundpipe::train {

// SIGINT and SIGTERM ask the loop to stop after the step in flight, while
// it runs; the previous handlers come back when it ends.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The signal received since (0: none).
  int received() const;

 private:
  struct sigaction previous_int_ {};
  struct sigaction previous_term_ {};
};

}  // namespace roundpipe::train

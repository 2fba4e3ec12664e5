// roundpipe-train's stop signals: see stop_signals.h.
#include "train/stop_signals.h"

#include <unistd.h>

#include <atomic>

namespace roundpipe::train {
namespace {

std::atomic<int> stop_signal{0};

extern "C" void on_stop_signal(int signal) {
  if (stop_signal.exchange(signal) != 0) {  // the second one: stop at once
    ::signal(signal, SIG_DFL);
    ::raise(signal);
    return;
  }
  static const char message[] =
      "\nroundpipe-train: stopping after the current step (a training checkpoint is saved "
      "unless it was the last; send the signal again to quit at once)\n";
  [[maybe_unused]] auto written = ::write(STDERR_FILENO, message, sizeof(message) - 1);
}

}  // namespace

StopSignals::StopSignals() {
  stop_signal = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, &previous_int_);
  ::sigaction(SIGTERM, &action, &previous_term_);
}

StopSignals::~StopSignals() {
  ::sigaction(SIGINT, &previous_int_, nullptr);
  ::sigaction(SIGTERM, &previous_term_, nullptr);
  stop_signal = 0;
}

int StopSignals::received() const {
  return stop_signal.load();
}

}  // namespace roundpipe::train

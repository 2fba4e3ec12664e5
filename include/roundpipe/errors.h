// The exception a failure inside the pipeline reaches the caller as.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <stdexcept>
#include <string>

namespace roundpipe {

// The message of an error without LibTorch's C++ backtrace (what a user
// reads; TORCH_CHECK's what() carries the frames too).
inline std::string error_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

// Thrown on the caller's thread when a stage job failed on a worker. The
// message names the RoundPipe, stage, layer, microbatch, phase and device,
// then the original error. The RoundPipe stays usable for the next call.
class StageError : public std::runtime_error {
 public:
  StageError(const std::string& message, std::string stage, int layer, int microbatch,
             std::string phase, std::string device, bool out_of_memory,
             std::exception_ptr cause = nullptr)
      : std::runtime_error(message),
        stage(std::move(stage)),
        layer(layer),
        microbatch(microbatch),
        phase(std::move(phase)),
        device(std::move(device)),
        out_of_memory(out_of_memory),
        cause(std::move(cause)) {}

  std::string stage;   // e.g. "forward stage 1 (layers 2..3)"
  int layer;           // -1 when not inside a layer
  int microbatch;      // -1 when not inside a microbatch
  std::string phase;   // upload, forward, recompute, backward, loss, download
  std::string device;  // "sim:1", "cuda:0"
  bool out_of_memory;  // the device ran out of memory
  // The error the layer (or loss function) threw, for frontends that re-raise
  // it as the cause (Python: the original exception becomes __cause__).
  std::exception_ptr cause;
};

}  // namespace roundpipe

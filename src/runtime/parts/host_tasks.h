// A host thread that runs tasks in order, each once the device event it
// waits for has completed (gradient sums, buffer commits, the optimizer's
// steps), and the marks that tell an engine's threads from others.
// Internal header.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "roundpipe/device.h"

namespace roundpipe::detail {

// Runs host work in order once the event it waits for has completed
// (gradient accumulation, buffer commits).
class HostTasks {
 public:
  // `owner`: the engine whose thread this is (see on_engine_thread()).
  explicit HostTasks(const void* owner);
  ~HostTasks();
  void post(EventPtr event, std::function<void()> task);
  // Waits until every posted task ran; rethrows the first failure.
  void drain();
  // Rethrows (once) a failure of a task that already ran, without waiting.
  void rethrow_failure();

 private:
  void loop();
  const void* owner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<EventPtr, std::function<void()>>> tasks_;
  int running_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// Whether the calling thread is one of `engine`'s own (a worker, uploader,
// host-task or optimizer thread): a step function, loss function or layer
// running inside it. Such code must not call the engine's blocking entry
// points, which would wait for the thread they run on.
bool on_engine_thread(const void* engine);
// Marks the calling thread as one of `engine`'s own.
void set_engine_thread(const void* engine);
// Whether the calling thread is one of any engine's own
// (roundpipe::on_roundpipe_thread()).
bool on_any_engine_thread();

}  // namespace roundpipe::detail

#include "runtime/parts/host_tasks.h"

namespace roundpipe::detail {

// Note [Calls from engine threads] (engine.cpp) says what the marks are for.
namespace {
thread_local const void* engine_of_this_thread = nullptr;
}  // namespace

bool on_engine_thread(const void* engine) {
  return engine != nullptr && engine_of_this_thread == engine;
}
void set_engine_thread(const void* engine) {
  engine_of_this_thread = engine;
}
bool on_any_engine_thread() {
  return engine_of_this_thread != nullptr;
}

HostTasks::HostTasks(const void* owner)
    : owner_(owner), thread_([this] {
        set_engine_thread(owner_);
        loop();
      }) {}

HostTasks::~HostTasks() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  thread_.join();
}

void HostTasks::post(EventPtr event, std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mu_);
  tasks_.emplace_back(std::move(event), std::move(task));
  cv_.notify_all();
}

void HostTasks::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return tasks_.empty() && running_ == 0; });
  if (error_) {
    auto error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

void HostTasks::rethrow_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) {
    auto error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

void HostTasks::loop() {
  for (;;) {
    std::pair<EventPtr, std::function<void()>> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
      ++running_;
    }
    try {
      if (task.first) task.first->synchronize();
      task.second();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    // The task's captures (tensors, events) go before it counts as done:
    // drain() returning means they are freed, not merely run.
    task = {};
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
    cv_.notify_all();
  }
}

}  // namespace roundpipe::detail

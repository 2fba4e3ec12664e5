// Work begun and not yet ended, with a wait for none left (a call's jobs
// and host tasks; the stage jobs in flight on all devices). Internal header.
#pragma once

#include <condition_variable>
#include <mutex>

namespace roundpipe::detail {

class WorkCounter {
 public:
  void begin() {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
  }
  void end() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--count_ == 0) cv_.notify_all();
  }
  void wait_none() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0;
};

}  // namespace roundpipe::detail

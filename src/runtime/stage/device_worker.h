// The two threads that serve one device: the worker runs the stage jobs
// dispatched to it, one at a time in dispatch order; the uploader walks the
// same queue and uploads each job's parameters as soon as memory allows
// (Note [Two stages resident]). Internal header.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "device/staging_ring.h"
#include "roundpipe/device.h"
#include "runtime/parts/call.h"
#include "runtime/parts/host_tasks.h"
#include "runtime/parts/stats_recorder.h"
#include "runtime/parts/weight_table.h"
#include "support/work_counter.h"

namespace roundpipe::detail {

class DeviceWorker;

// What the workers use of the engine; owned by it, outlives them.
struct WorkerContext {
  const void* owner;  // the engine (its threads' marks)
  WeightTable& weights;
  HostTasks& host_tasks;  // read releases once uploads have copied
  StatsRecorder& stats;
  WorkCounter& in_flight;  // stage jobs dispatched and not yet finished, all devices
  // Runs one stage job on the worker's device (errors go to its call).
  std::function<void(Job&, DeviceWorker&)> run;
  // After the job ran and its upload is done: settles what it held.
  std::function<void(Job&)> finished;
};

class DeviceWorker {
 public:
  DeviceWorker(WorkerContext& context, DevicePtr device);
  ~DeviceWorker();  // finishes the queued jobs, joins the threads
  DeviceWorker(const DeviceWorker&) = delete;
  DeviceWorker& operator=(const DeviceWorker&) = delete;

  void submit(std::shared_ptr<Job> job);
  Device& device() { return *device_; }
  // The ring its parameter uploads go through (null: the homes are pinned).
  StagingRing* staging() { return staging_.get(); }
  // Waits until the uploader has enqueued the job's parameter upload (the
  // compute queue then waits for job.params_ready on the device); rethrows
  // the upload's error; throws CallAborted when its call failed meanwhile.
  void wait_for_upload(Job& job);

 private:
  void loop();
  void upload_loop();
  void upload(Job& job);
  void upload_making_room(Job& job, int64_t jobs_before);

  WorkerContext& context_;
  DevicePtr device_;
  // Pinned slots for pageable parameter uploads (Note [Staging ring]), when
  // the homes may be pageable.
  std::unique_ptr<StagingRing> staging_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;     // front: the running job
  std::deque<std::shared_ptr<Job>> uploads_;  // front: the next upload
  int64_t jobs_done_ = 0;                     // jobs the worker has finished, in dispatch order
  bool stop_ = false;
  std::string trace_name_, uploader_name_;
  std::thread thread_, uploader_;
};

}  // namespace roundpipe::detail

// A device's worker and uploader threads: see device_worker.h.
#include "runtime/stage/device_worker.h"

#include "support/trace.h"

namespace roundpipe::detail {

DeviceWorker::DeviceWorker(WorkerContext& context, DevicePtr device)
    : context_(context), device_(std::move(device)) {
  if (context_.weights.pageable_homes()) {
    staging_ = std::make_unique<StagingRing>(
        kStagingSlots, staging_slot_bytes(context_.weights.host_memory_stats().model_state_bytes),
        device_->supports_pinned_memory(), kStagingThreads);
  }
  thread_ = std::thread([this] {
    set_engine_thread(context_.owner);
    device_->bind_compute_thread();
    trace_name_ = device_->name();
    trace_who = trace_name_.c_str();
    loop();
  });
  uploader_ = std::thread([this] {
    set_engine_thread(context_.owner);
    device_->bind_compute_thread();
    uploader_name_ = device_->name() + " uploader";
    trace_who = uploader_name_.c_str();
    upload_loop();
  });
}

DeviceWorker::~DeviceWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  thread_.join();
  uploader_.join();
}

void DeviceWorker::submit(std::shared_ptr<Job> job) {
  context_.in_flight.begin();
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.push_back(job);
  uploads_.push_back(std::move(job));
  cv_.notify_all();
}

void DeviceWorker::wait_for_upload(Job& job) {
  const auto start = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return job.upload_done; });
  }
  if (ms_since(start) > 0.5)
    ROUNDPIPE_TRACE("call %lld: waited %.1f ms for the upload of %s",
                    static_cast<long long>(job.call->id), ms_since(start), job.describe().c_str());
  if (job.upload_error) std::rethrow_exception(job.upload_error);
  if (!job.params_ready) throw CallAborted{};  // skipped: the call failed meanwhile
}

void DeviceWorker::loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = jobs_.front();
    }
    ROUNDPIPE_TRACE("call %lld: start %s", static_cast<long long>(job->call->id),
                    job->describe().c_str());
    context_.run(*job, *this);
    ROUNDPIPE_TRACE("call %lld: enqueued %s", static_cast<long long>(job->call->id),
                    job->describe().c_str());
    auto end = device_->record(Queue::kCompute);
    {
      // The uploader is done with this job too (a job of an aborted call
      // returns without waiting for it): what it holds can be released.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return job->upload_done; });
      *job->end = std::move(end);
      jobs_.pop_front();
      cv_.notify_all();
    }
    context_.finished(*job);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++jobs_done_;
      cv_.notify_all();
    }
    context_.in_flight.end();
  }
}

// Note [Two stages resident]
// A job's parameters are uploaded once the job two before it on this
// device has left it, so at most two stages' parameters are resident (one
// running, one arriving), as the plan's memory budget assumes. That host
// wait is the uploader's alone: the worker never stops enqueuing compute
// for it.
void DeviceWorker::upload_loop() {
  std::deque<std::shared_ptr<EventPtr>> recent;  // ends of the (up to) two jobs before
  for (int64_t jobs_before = 0;; ++jobs_before) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !uploads_.empty(); });
      if (uploads_.empty()) return;
      job = uploads_.front();
      uploads_.pop_front();
    }
    try {
      if (recent.size() == 2) {
        EventPtr two_back;
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return *recent.front() != nullptr; });
          two_back = *recent.front();
        }
        recent.pop_front();
        // (A device error of that job surfaces here: it becomes this
        // job's upload error, reported with its context.)
        two_back->synchronize();
      }
    } catch (...) {
      job->upload_error = std::current_exception();
    }
    recent.push_back(job->end);
    if (!job->upload_error) {
      try {
        upload_making_room(*job, jobs_before);
      } catch (...) {
        job->upload_error = std::current_exception();
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    job->upload_done = true;
    cv_.notify_all();
  }
}

// Note [Upload out of memory]
// A stage's parameters arrive while the stage before it on the device
// still runs (Note [Two stages resident]); the plan budgets for both, but a
// microbatch that needs more than its estimate (a longer row, a kernel's
// workspace, memory another program took) can leave the arriving stage no
// room. Such an upload waits until every earlier job on this device has
// finished and its memory is back (the caching allocator hands memory that
// was another stream's to this one once it has released its cached
// blocks, which it does before failing an allocation), then tries once
// more. Only a stage whose parameters do not fit beside nothing of ours
// fails; that error reaches the call as before (Note [Out-of-memory redo]).
// The wait costs the overlap of that one upload with the compute before it.
void DeviceWorker::upload_making_room(Job& job, int64_t jobs_before) {
  try {
    upload(job);
    return;
  } catch (const c10::OutOfMemoryError&) {
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return jobs_done_ >= jobs_before; });
  }
  device_->record(Queue::kCompute)->synchronize();  // the earlier jobs' frees have happened
  ROUNDPIPE_TRACE("call %lld: parameter upload of %s ran out of memory; retried alone",
                  static_cast<long long>(job.call->id), job.describe().c_str());
  context_.stats.count(&PipelineStats::upload_out_of_memory_retries);
  upload(job);
}

void DeviceWorker::upload(Job& job) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t version = job.call->weights_version;
  auto& weights = context_.weights;
  // A failing call wakes this wait (Note [Call cancellation]).
  const bool available =
      weights.wait_available(job.param_ids, version, [&] { return job.call->aborted.load(); });
  context_.stats.add_since(&PipelineStats::weight_wait_seconds, start);
  const double weights_ms = ms_since(start);
  if (!available) return;  // the call failed: nothing to run
  auto [copies, event] =
      device_->upload(Queue::kParamUpload, weights.tensors_to_upload(job.param_ids, version),
                      nullptr, staging_.get());
  ROUNDPIPE_TRACE(
      "call %lld: parameter upload of %s enqueued (after %.1f ms, %.1f of them "
      "waiting for the weights)",
      static_cast<long long>(job.call->id), job.describe().c_str(), ms_since(start), weights_ms);
  job.device_params = std::move(copies);
  job.params_ready = event;
  // Once the copies have read the host tensors, the optimizer may publish.
  job.reads_released = true;
  context_.host_tasks.post(
      event, [&weights, ids = job.param_ids, version] { weights.release_reads(ids, version); });
}

}  // namespace roundpipe::detail

// A device's worker and uploader (runtime/stage/device_worker.h) on one
// simulated device, with the job runner replaced by the test's own (the
// engine's runs a stage; here it records what the worker hands it): jobs
// run one at a time in submit order on uploads of exactly their parameters;
// at most two jobs' parameters are uploaded ahead (Note [Two stages
// resident]); an upload that finds no room is retried once and its error
// reaches wait_for_upload; a job of a call that failed while its upload
// waited finishes without one.
#include "runtime/stage/device_worker.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

using namespace std::chrono_literals;
using detail::CallState;
using detail::DeviceWorker;
using detail::Job;

// The MLP: Linear(6, 16), Tanh, Linear(16, 16), ReLU, Linear(16, 4).
constexpr int kLayers = 5;

// What a DeviceWorker uses of the engine, wired as Engine's constructor
// does; `run` is the test's, `finished` is Engine::job_finished.
struct WorkerParts {
  std::vector<LayerPtr> layers = layers_of(make_model(ModelKind::kMlp));
  DevicePool pool;
  detail::WeightTable weights;
  detail::HostTasks host_tasks{this};
  detail::StatsRecorder stats;
  detail::WorkCounter in_flight;
  std::function<void(Job&, DeviceWorker&)> run = [](Job&, DeviceWorker&) {};
  detail::WorkerContext context;
  std::unique_ptr<DeviceWorker> worker;  // last: its threads use the parts

  explicit WorkerParts(const std::string& spec = "sim:1")
      : pool(make_devices(spec)),
        weights(layers, PinMode::kAlloc, pool.at(0)->supports_pinned_memory(), "worker test"),
        context{this,
                weights,
                host_tasks,
                stats,
                in_flight,
                [this](Job& job, DeviceWorker& w) { run(job, w); },
                [this](Job& job) { finished(job); }},
        worker(std::make_unique<DeviceWorker>(context, pool.at(0))) {}
  ~WorkerParts() { worker.reset(); }

  std::shared_ptr<CallState> new_call(int64_t weights_version = 0) {
    auto call = std::make_shared<CallState>();
    call->weights_version = weights_version;
    call->wakers.push_back([this] { weights.wake(); });  // Note [Call cancellation]
    return call;
  }
  // A forward job of `layer`, counted as Engine::dispatch counts it.
  std::shared_ptr<Job> job_of(const std::shared_ptr<CallState>& call, int layer) {
    auto job = std::make_shared<Job>();
    job->kind = detail::JobKind::kForward;
    job->range = {layer, layer + 1};
    job->stage_index = layer;
    job->call = call;
    job->param_ids = weights.layer_param_ids(layer);
    weights.add_reads(job->param_ids, call->weights_version);
    call->work.begin();
    return job;
  }
  int64_t param_bytes(int layer) const {
    int64_t bytes = 0;
    for (int id : weights.layer_param_ids(layer)) bytes += weights.home(id).nbytes();
    return bytes;
  }
  int64_t uploaded() const { return pool.at(0)->transfer_stats().param_upload_bytes; }

 private:
  void finished(Job& job) {
    if (!job.reads_released) {  // no upload read them (the call failed first)
      job.reads_released = true;
      weights.release_reads(job.param_ids, job.call->weights_version);
    }
    job.call->work.end();
  }
};

TEST(DeviceWorker, JobsRunOneAtATimeInSubmitOrderOnUploadsOfTheirParameters) {
  WorkerParts parts;
  std::mutex mu;
  std::vector<int> order;
  std::map<int, std::vector<at::Tensor>> seen;  // per layer: its parameters on the device
  std::atomic<int> running{0}, most_running{0};
  parts.run = [&](Job& job, DeviceWorker& worker) {
    most_running = std::max(most_running.load(), ++running);
    worker.wait_for_upload(job);
    job.params_ready->synchronize();
    // The first job lingers: a worker that did not run jobs one at a time
    // in order would let the later ones overtake it meanwhile.
    if (job.range.begin == 0) std::this_thread::sleep_for(30ms);
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(job.range.begin);
    for (const auto& t : job.device_params) seen[job.range.begin].push_back(t.clone());
    --running;
  };
  auto call = parts.new_call();
  std::vector<std::shared_ptr<Job>> jobs;
  for (int l = 0; l < kLayers; ++l) jobs.push_back(parts.job_of(call, l));
  for (auto& job : jobs) parts.worker->submit(job);
  call->work.wait_none();
  parts.in_flight.wait_none();
  parts.host_tasks.drain();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(most_running.load(), 1);
  int64_t bytes = 0;
  for (int l = 0; l < kLayers; ++l) {
    const auto& ids = parts.weights.layer_param_ids(l);
    ASSERT_EQ(jobs[l]->device_params.size(), ids.size()) << "layer " << l;
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto& copy = jobs[l]->device_params[i];
      EXPECT_EQ(copy.device(), parts.pool.at(0)->torch_device());
      EXPECT_NE(copy.data_ptr(), parts.weights.home(ids[i]).data_ptr()) << "not a copy";
      EXPECT_TRUE(seen[l].at(i).equal(parts.weights.home(ids[i]))) << "layer " << l << " " << i;
    }
    EXPECT_TRUE(jobs[l]->reads_released);  // by the upload, once its copy had read them
    EXPECT_NE(*jobs[l]->end, nullptr);     // the compute queue's mark at its end
    bytes += parts.param_bytes(l);
  }
  EXPECT_EQ(parts.uploaded(), bytes);  // each job's parameters, once
}

TEST(DeviceWorker, AtMostTwoJobsParametersAreUploadedBeforeTheFirstEnds) {
  WorkerParts parts;
  std::promise<void> release;
  auto released = release.get_future().share();
  parts.run = [&](Job& job, DeviceWorker& worker) {
    worker.wait_for_upload(job);
    if (job.range.begin == 0) released.wait();
  };
  auto call = parts.new_call();
  for (int l : {0, 2, 4}) parts.worker->submit(parts.job_of(call, l));  // the three Linears
  const int64_t two = parts.param_bytes(0) + parts.param_bytes(2);
  const auto deadline = std::chrono::steady_clock::now() + 30s;  // a starved uploader too
  while (parts.uploaded() < two && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  // The third upload waits for the end of the first job, however long.
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(parts.uploaded(), two);
  release.set_value();
  call->work.wait_none();
  EXPECT_EQ(parts.uploaded(), two + parts.param_bytes(4));
}

TEST(DeviceWorker, AnUploadThatFindsNoRoomIsRetriedOnceAndItsErrorReachesTheJob) {
  // 512 bytes of device memory: Linear(16, 16)'s 1088 bytes never fit,
  // Linear(6, 16)'s 448 do.
  WorkerParts parts("sim:1,mem=512");
  ASSERT_GT(parts.param_bytes(2), 512);
  ASSERT_LE(parts.param_bytes(0), 512);
  std::mutex mu;
  std::map<int, std::string> outcome;  // per layer
  parts.run = [&](Job& job, DeviceWorker& worker) {
    std::string what = "uploaded";
    try {
      worker.wait_for_upload(job);
      job.params_ready->synchronize();
    } catch (const c10::OutOfMemoryError& e) {
      what = std::string("out of memory: ") + e.what();
    }
    std::lock_guard<std::mutex> lock(mu);
    outcome[job.range.begin] = what;
  };
  auto call = parts.new_call();
  auto big = parts.job_of(call, 2), small = parts.job_of(call, 0);
  parts.worker->submit(big);
  parts.worker->submit(small);
  call->work.wait_none();
  EXPECT_HAS(outcome[2], "out of memory");
  EXPECT_TRUE(big->device_params.empty());
  // Retried alone once the jobs before had finished, then given up.
  EXPECT_EQ(parts.stats.snapshot().upload_out_of_memory_retries, 1);
  // The next job's upload is not held up by the failed one.
  EXPECT_EQ(outcome[0], "uploaded");
  EXPECT_EQ(small->device_params.size(), parts.weights.layer_param_ids(0).size());
}

TEST(DeviceWorker, AJobOfACallThatFailedWhileItsUploadWaitedFinishesWithoutOne) {
  WorkerParts parts;
  std::atomic<int> outcome{0};  // 0: still waiting, 1: uploaded, 2: aborted
  parts.run = [&](Job& job, DeviceWorker& worker) {
    try {
      worker.wait_for_upload(job);
      outcome = 1;
    } catch (const detail::CallAborted&) {
      outcome = 2;
    }
  };
  // Version 1 of the weights is never published: the upload waits for it.
  auto call = parts.new_call(/*weights_version=*/1);
  auto job = parts.job_of(call, 0);
  parts.worker->submit(job);
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(outcome.load(), 0);
  call->fail(StageError("injected failure", "forward stage 1 (layers 1..1)", -1, 0, "forward",
                        "sim:0", false));
  call->work.wait_none();
  EXPECT_EQ(outcome.load(), 2);
  EXPECT_TRUE(job->device_params.empty());
  EXPECT_EQ(job->params_ready, nullptr);
  EXPECT_EQ(parts.uploaded(), 0);
  EXPECT_TRUE(job->reads_released);  // by job_finished, as no upload read them
}

}  // namespace
}  // namespace roundpipe::testing

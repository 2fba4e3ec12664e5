// The RoundPipe engine: see engine.h and docs/architecture.md.
#include "runtime/engine/engine.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <set>
#include <sstream>

#include "roundpipe/errors.h"
#include "roundpipe/microbatch.h"
#include "runtime/engine/autograd_bridge.h"
#include "runtime/values/ivalue_tree.h"
#include "runtime/values/rng.h"
#include "runtime/values/transfer.h"
#include "support/trace.h"

namespace roundpipe::detail {

Engine::Engine(std::vector<LayerPtr> layers, RoundPipeOptions options)
    : name_(options.name.empty() ? "RoundPipe" : options.name),
      options_(std::move(options)),
      layers_(std::move(layers)),
      pool_(options_.device_list.empty()
                ? make_devices(options_.devices.empty() ? default_device_spec() : options_.devices)
                : options_.device_list),
      weights_(layers_, options_.pin_model, pool_.at(0)->supports_pinned_memory(), name_),
      timings_(num_layers(), options_.verbose),
      instances_(layers_),
      auto_plan_(name_, options_, pool_, layers_, weights_, timings_, commits_),
      recovery_(
          name_, layers_,
          [this](const ExecutePlan& failed, RecomputeGrain grain, bool grain_chosen) {
            auto_plan_.shrink_after_out_of_memory(failed, grain, grain_chosen);
          },
          stats_, [this] { drain_host_tasks(); }),
      stage_context_{name_,
                     layers_,
                     weights_,
                     instances_,
                     timings_,
                     host_tasks_,
                     grad_tasks_,
                     grads_,
                     commits_,
                     stats_,
                     [this](const CallState& call, const std::string& stage,
                            const std::string& device, const std::string& message) {
                       recovery_.shrink(call, stage, device, "the microbatch was retried by layer",
                                        message);
                     },
                     callers_loss_},
      worker_context_{
          this,
          weights_,
          host_tasks_,
          stats_,
          in_flight_,
          [this](Job& job, DeviceWorker& worker) { run_stage_job(stage_context_, job, worker); },
          [this](Job& job) { job_finished(job); }},
      optimizer_(this, weights_, grads_, stats_, options_.optim_dtype,
                 options_.data_parallel.get()) {
  for (const auto& device : pool_.devices()) {
    workers_.push_back(std::make_unique<DeviceWorker>(worker_context_, device));
  }
}

Engine::~Engine() {
  // Pending work finishes and an async step's update is published, as
  // synchronize() does: the model keeps every update it was given. A
  // destructor cannot throw, so an error the caller never collected is
  // printed rather than lost.
  try {
    synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: destroyed with an error it had not reported yet: %s\n", name_.c_str(),
                 error_message(e).c_str());
    try {
      settle();  // the rest of its work, whatever failed
      optimizer_.publish_pending();
    } catch (...) {
    }
  } catch (...) {
  }
  workers_.clear();
}

// ---------------------------------------------------------------- the model

std::vector<at::Tensor> Engine::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, home] : weights_.named_homes()) out.push_back(home);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::named_parameters() const {
  return weights_.named_homes();
}

std::vector<std::pair<std::string, at::Tensor>> Engine::named_buffers() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const auto names = layers_[l]->buffer_names();
    const auto buffers = layers_[l]->buffers();
    for (size_t i = 0; i < buffers.size(); ++i) {
      out.emplace_back(std::to_string(l) + "." + names.at(i), buffers[i]);
    }
  }
  return out;
}

std::vector<at::Tensor> Engine::optim_parameters() {
  std::vector<at::Tensor> out;
  for (auto& [name, master] : optim_named_parameters()) out.push_back(master);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::optim_named_parameters() {
  return optimizer_.named_masters();
}

PlanEstimate Engine::auto_plan(bool fused, int num_microbatches, int min_stages,
                               std::optional<double> memory_limit_gib,
                               std::optional<RecomputeGrain> grain, int tail_rows) const {
  return auto_plan_
      .choose(fused, num_microbatches, min_stages, memory_limit_gib,
              grain ? grain : options_.model_run_config.recompute_grain, tail_rows)
      .estimate;
}

ExecutePlan Engine::default_plan(bool fused) {
  return auto_plan_
      .for_call(
          fused,
          options_.model_run_config.num_microbatch.value_or(default_num_microbatch(pool_.size())),
          options_.model_run_config.recompute_grain)
      .plan;
}

// ---------------------------------------------------------------- calls

// Note [Calls from engine threads]
// Step functions run on the optimizer thread, loss functions and layers on
// the device workers. A blocking entry point called from there (say
// synchronize() inside a step function, or forward_backward() inside a
// synchronous step) would wait for work queued behind the very task that
// is waiting: a deadlock. Those calls are refused with an error instead;
// another RoundPipe's calls are fine.
void Engine::check_caller_thread(const char* what) const {
  TORCH_CHECK(!on_engine_thread(this), name_, ": ", what,
              " was called from inside this RoundPipe (a step function, loss function or layer "
              "it runs), where it would wait for itself forever. Call it from the training loop, "
              "after step() or forward_backward() has returned.");
}

RunConfig Engine::resolve(const RunConfig& config) const {
  RunConfig out = config.overriding(options_.model_run_config);
  if (!out.requires_grad) out.requires_grad = c10::GradMode::is_enabled();
  if (!out.output_device) out.output_device = c10::Device(c10::kCPU);
  if (!out.preserve_rng_state) out.preserve_rng_state = true;
  if (!out.recompute_grain) out.recompute_grain = RecomputeGrain::kStage;
  if (!out.num_microbatch) out.num_microbatch = default_num_microbatch(pool_.size());
  if (!out.loss_sums_over_rows) out.loss_sums_over_rows = false;
  return out;
}

std::shared_ptr<CallState> Engine::start_call(const c10::IValue& input, const RunConfig& config,
                                              CallKind kind, const CallState* redo_of) {
  const auto start = std::chrono::steady_clock::now();
  check_earlier_calls();
  stats_.add_since(&PipelineStats::call_start_wait_seconds, start);
  weights_.release_idle_host_memory();
  auto call = std::make_shared<CallState>();
  // Every engine wait that may wait on this call (Note [Call cancellation]).
  call->wakers.push_back([this] { commits_.wake(); });
  call->wakers.push_back([this] { grads_.wake(); });
  call->wakers.push_back([this] { weights_.wake(); });
  // The caller's grain, if any: else the automatic plan chooses it.
  const auto asked_grain = config.overriding(options_.model_run_config).recompute_grain;
  call->config = resolve(config);
  call->fused = kind == CallKind::kForwardBackward;
  call->training = kind != CallKind::kForward;
  call->n = *call->config.num_microbatch;
  // A batch of fewer rows than num_microbatch runs as that many
  // microbatches (the original's splitter does so); a split of the
  // caller's or a packed input keeps its count.
  if (!call->config.packed_input.value_or(false) && !call->config.split_input && call->n >= 1)
    call->n = microbatch_count(input, call->n);
  call->grain = *call->config.recompute_grain;
  call->preserve_rng = *call->config.preserve_rng_state;
  call->weights_version = redo_of ? redo_of->weights_version : optimizer_.version_for_new_calls();
  call->id = calls_started_++;
  ROUNDPIPE_TRACE("call %lld: starts after %.1f ms waiting for earlier calls, reads weights v%lld",
                  static_cast<long long>(call->id), ms_since(start),
                  static_cast<long long>(call->weights_version));
  TORCH_CHECK(call->n >= 1, name_, ": num_microbatch must be at least 1, got ", call->n);
  const auto microbatches = call->split_input(input, name_);
  if (call->config.execute_plan) {
    call->plan = *call->config.execute_plan;
  } else {
    // Where the loss adds up over rows, the fused tail may split the
    // smallest microbatch's rows (Note [Tail row chunks], layer.h).
    // A caller's loss function, once a whole microbatch showed it a
    // candidate, is checked chunk by chunk (Note [A caller's loss over row
    // chunks]); not with data parallel, whose ranks would redo apart.
    int tail_rows = 0, largest_rows = 0;
    call->check_chunk_loss = !*call->config.loss_sums_over_rows;
    const bool rows_add_up = *call->config.loss_sums_over_rows ||
                             (callers_loss_ == kCallersLossChunks && data_parallel() == nullptr);
    if (call->fused && rows_add_up) {
      tail_rows = std::numeric_limits<int>::max();
      for (const auto& m : microbatches) {
        const auto tensors = flatten_tensors(m);
        const bool any = std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
          return t.defined() && t.dim() > 0;
        });
        const int rows = any ? static_cast<int>(batch_size_of(m)) : 0;
        tail_rows = std::min(tail_rows, rows);
        largest_rows = std::max(largest_rows, rows);
      }
      if (tail_rows == 0) largest_rows = 0;
    }
    auto chosen = auto_plan_.for_call(call->fused, call->n, asked_grain, {tail_rows, largest_rows});
    call->plan = std::move(chosen.plan);
    call->grain = chosen.grain;
    call->grain_chosen = !asked_grain;
    call->tail_layers_with_grad = chosen.tail_layers_with_grad;
    call->tail_row_chunks = chosen.tail_row_chunks;
    call->rerun_inputs_on_device = chosen.rerun_inputs_on_device;
    call->config.recompute_grain = chosen.grain;
    if (call->training)
      stats_.set(&PipelineStats::last_call_planned_peak_bytes, chosen.predicted_peak_bytes);
  }
  call->plan.validate(num_layers(), call->fused);
  if (call->training && call->grain == RecomputeGrain::kLayerFromStage)
    stats_.count(&PipelineStats::calls_with_thin_checkpoints);
  if (call->preserve_rng)
    call->call_seed = redo_of ? redo_of->call_seed : draw_call_seed(*pool_.at(0));
  call->make_slots(num_layers());
  call->put_inputs(microbatches);
  return call;
}

void Engine::dispatch(const std::shared_ptr<CallState>& call, CallPhase phase) {
  // The jobs take consecutive turns of the pool's round-robin, carried
  // across calls: reserve as many turns as the phase has jobs.
  const int devices = pool_.size();
  const auto turns = static_cast<int>(schedule_call(call->plan, phase, devices, 0, call->n).size());
  for (const auto& job : schedule_call(call->plan, phase, devices, pool_.take(turns), call->n))
    dispatch(call, job);
}

void Engine::dispatch(const std::shared_ptr<CallState>& call, const ScheduledJob& scheduled) {
  auto job = std::make_shared<Job>();
  static_cast<ScheduledJob&>(*job) = scheduled;
  job->call = call;
  const auto& range = scheduled.range;
  std::set<int> seen;
  for (int l = range.begin; l < range.end; ++l) {
    for (int id : weights_.layer_param_ids(l)) {
      if (seen.insert(id).second) job->param_ids.push_back(id);
    }
  }
  weights_.add_reads(job->param_ids, call->weights_version);
  if (scheduled.kind != JobKind::kForward && call->training) {
    std::vector<int> trainable;
    for (int id : job->param_ids) {
      if (weights_.trainable(id)) trainable.push_back(id);
    }
    grads_.expect(call->grads, trainable);
  }
  if (scheduled.kind != JobKind::kBackward) {
    // Later calls' forwards of these layers read the buffers it commits.
    for (int l = range.begin; l < range.end; ++l) {
      if (!layers_[l]->buffers().empty()) job->commit_layers.push_back(l);
    }
    commits_.expect(job->commit_layers, call->id);
    if (!job->commit_layers.empty()) ++call->commits_left;
  }
  call->work.begin();
  workers_[scheduled.device]->submit(std::move(job));
}

void Engine::job_finished(Job& job) {
  if (!job.reads_released) {  // no upload read them (the call failed first)
    job.reads_released = true;
    weights_.release_reads(job.param_ids, job.call->weights_version);
  }
  if (!job.commit_posted) commits_.settle(job.commit_layers, job.call->id);
  job.call->work.end();
}

std::vector<c10::IValue> Engine::collect(const std::shared_ptr<CallState>& call,
                                         std::vector<std::shared_ptr<Slot>>& slots) {
  std::vector<c10::IValue> values;
  try {
    for (auto& slot : slots) {
      Slot& s = call->wait(slot);
      if (s.event) s.event->synchronize();
      values.push_back(s.tensors.empty() ? s.value : c10::IValue(s.tensors.front()));
    }
  } catch (const CallAborted&) {
    in_flight_.wait_none();
    call->rethrow_if_failed();
    throw;
  }
  return values;
}

void Engine::run_backward_pass(const std::shared_ptr<CallState>& call) {
  dispatch(call, CallPhase::kBackward);
  // Wait for this call's backward jobs and gradient downloads.
  call->work.wait_none();
  if (call->aborted) call->reported = true;  // thrown here, through autograd: once
  call->rethrow_if_failed();
}

c10::IValue Engine::forward(const c10::IValue& input, const RunConfig& config) {
  check_caller_thread("forward()");
  const bool training = resolve(config).requires_grad.value();
  std::shared_ptr<CallState> call;
  auto outs = run_call(
      input, config, training ? CallKind::kTrainingForward : CallKind::kForward, call,
      [](CallState&) {}, [&](CallState & c) -> auto& { return c.act.at(num_layers()); });
  // Buffer writes are committed once the forward's jobs are done: make them
  // visible before returning.
  in_flight_.wait_none();
  drain_host_tasks();
  auto to_output_device = [&](const c10::IValue& v) {
    return to_device(v, *call->config.output_device);
  };
  const bool packed = call->config.pack_output.value_or(false);
  if (call->config.merge_output && !packed) {
    TORCH_CHECK(!training, name_,
                ": a custom merge_output cannot be differentiated through; run "
                "with requires_grad=false or use forward_backward");
    return to_output_device((*call->config.merge_output)(outs));
  }
  auto merged = packed ? c10::IValue(c10::ivalue::Tuple::create(outs)) : merge_microbatches(outs);
  if (!training) return to_output_device(merged);
  auto connected = connect_to_autograd(
      call, input, outs, merged, [this](const auto& c) { run_backward_pass(c); }, name_,
      num_layers());
  unconsumed_calls_.push_back(call);  // its gradients come with its backward
  return to_output_device(connected);
}

ForwardBackwardResult Engine::forward_backward(const c10::IValue& input, const c10::IValue& label,
                                               const LossFn& loss_fn, bool return_outputs,
                                               const RunConfig& config) {
  check_caller_thread("forward_backward()");
  TORCH_CHECK(loss_fn, name_, ": forward_backward needs a loss_fn");
  std::shared_ptr<CallState> call;
  auto losses = run_call(
      input, config, CallKind::kForwardBackward, call,
      [&](CallState& c) {
        c.loss_fn = loss_fn;
        c.return_outputs = return_outputs;
        c.split_labels(label, name_);
      },
      [](CallState & c) -> auto& { return c.losses; });
  ROUNDPIPE_TRACE("call %lld: losses collected", static_cast<long long>(call->id));
  // From here the call's backward stages (the last microbatch's included:
  // the losses come before it) run on in the background; the next call,
  // step() and synchronize() report their errors and take its gradients.
  unconsumed_calls_.push_back(call);
  send_input_grads_upstream(call, input);
  ForwardBackwardResult result;
  at::Tensor total = losses[0].toTensor().clone();
  for (size_t m = 1; m < losses.size(); ++m) total.add_(losses[m].toTensor());
  result.loss = total;
  if (return_outputs) {
    std::vector<c10::IValue> outs;
    try {
      outs = collect(call, call->outputs);
    } catch (...) {
      // The call failed: reported here, so not again by the next call.
      if (call->aborted) std::erase(unconsumed_calls_, call);
      throw;
    }
    if (call->config.pack_output.value_or(false)) {
      result.output = c10::ivalue::Tuple::create(outs);
    } else {
      result.output =
          call->config.merge_output ? (*call->config.merge_output)(outs) : merge_microbatches(outs);
    }
    result.output = to_device(result.output, *call->config.output_device);
  }
  return result;
}

std::vector<c10::IValue> Engine::run_call(
    const c10::IValue& input, const RunConfig& config, CallKind kind,
    std::shared_ptr<CallState>& call, const std::function<void(CallState&)>& prepare,
    const std::function<std::vector<std::shared_ptr<Slot>>&(CallState&)>& results) {
  for (int attempt = 0;; ++attempt) {
    auto failed = std::move(call);
    call = start_call(input, config, kind, failed.get());
    // The failed call's saved activations and downloads go before the
    // redo makes its own: held on, they doubled the host memory of a
    // redone call (101 GiB for a 32B model's 16 x 4096 tokens).
    failed.reset();
    prepare(*call);
    dispatch(call, kind == CallKind::kForwardBackward ? CallPhase::kFused : CallPhase::kForward);
    try {
      return collect(call, results(*call));
    } catch (const StageError& e) {
      // (Later calls run their tails whole: callers_loss_ says so already.)
      if (call->loss_check_failed && callers_loss_ == kCallersLossWhole) {
        recovery_.undo(*call);
        stats_.count(&PipelineStats::calls_redone_for_the_loss_check);
        continue;
      }
      if (!recovery_.undo_for_redo(*call, e, attempt)) throw;
    }
  }
}

// As the original does: a forward_backward whose inputs require grad sends
// their gradients upstream before it returns, so that a RoundPipe fed by
// another one's forward() (a model in two parts) trains end to end. Such a
// call waits for its backward stages.
void Engine::send_input_grads_upstream(const std::shared_ptr<CallState>& call,
                                       const c10::IValue& input) {
  const auto& wanted = call->input_requires_grad;
  if (std::none_of(wanted.begin(), wanted.end(), [](bool w) { return w; })) return;
  call->work.wait_none();
  if (call->aborted) {
    std::erase(unconsumed_calls_, call);  // reported here, not again by the next call
    call->rethrow_if_failed();
  }
  const auto num_inputs = static_cast<int64_t>(flatten_tensors(input).size());
  backward_through(input, merged_input_grads(*call, num_inputs));
}

// ---------------------------------------------------------------- steps and waits

std::vector<std::shared_ptr<CallState>> Engine::take_unconsumed_calls() {
  auto calls = std::move(unconsumed_calls_);
  unconsumed_calls_.clear();
  return calls;
}

void Engine::step(std::function<void()> step_fn, bool is_async) {
  check_caller_thread("step()");
  TORCH_CHECK(step_fn, name_, ": step() needs a step function");
  optimizer_.prepare_step();
  optimizer_.step(take_unconsumed_calls(), std::move(step_fn), is_async);
}

void Engine::step_fused(optim::Adam& adam, bool is_async, optim::GradScaler* scaler,
                        optim::GradClipper* clip) {
  check_caller_thread("step()");
  optimizer_.prepare_step();
  optimizer_.step_fused(take_unconsumed_calls(), adam, is_async, scaler, clip);
}

void Engine::step_fused(optim::FusedUpdate update, bool is_async) {
  check_caller_thread("step()");
  TORCH_CHECK(update, name_, ": step() needs an update function");
  optimizer_.prepare_step();
  optimizer_.step_fused(take_unconsumed_calls(), std::move(update), is_async);
}

void Engine::report_failed_call() {
  // A training call that failed in the background is reported once, here.
  std::erase_if(unconsumed_calls_, [](const auto& call) { return call->reported.load(); });
  for (auto it = unconsumed_calls_.begin(); it != unconsumed_calls_.end(); ++it) {
    if ((*it)->aborted) {
      auto failed = *it;
      unconsumed_calls_.erase(it);
      failed->rethrow_if_failed();
    }
  }
}

void Engine::check_earlier_calls() {
  optimizer_.rethrow_failure();
  host_tasks_.rethrow_failure();
  grad_tasks_.rethrow_failure();
  report_failed_call();
}

void Engine::drain_host_tasks() {
  // Every queue drains even when one has an error to report (a task left
  // queued would outlive the members it uses); then the first error.
  std::exception_ptr error;
  for (auto* tasks : {&host_tasks_, &grad_tasks_}) {
    try {
      tasks->drain();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

void Engine::settle() {
  in_flight_.wait_none();
  std::exception_ptr error;
  try {
    drain_host_tasks();
  } catch (...) {
    error = std::current_exception();
  }
  try {
    optimizer_.drain();
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  if (error) std::rethrow_exception(error);
}

void Engine::synchronize() {
  check_caller_thread("synchronize()");
  settle();
  optimizer_.publish_pending();
  for (auto& [id, g] : optimizer_.take_gradients(take_unconsumed_calls())) {
    auto home = weights_.home(id);
    auto& grad = home.mutable_grad();
    grad = grad.defined() ? grad.add_(g) : g;
  }
}

double Engine::measure_weight_upload_rate() {
  synchronize();
  auto& worker = *workers_.at(0);
  auto& device = worker.device();
  // Layer by layer from where the weights live, as stage jobs upload them
  // (through the staging ring where they may be pageable), at most two
  // layers' copies held on the device.
  const auto start = std::chrono::steady_clock::now();
  int64_t bytes = 0;
  std::vector<EventPtr> done;
  std::vector<std::vector<at::Tensor>> held;
  for (int l = 0; l < num_layers(); ++l) {
    std::vector<at::Tensor> host;
    for (int id : weights_.layer_param_ids(l)) {
      host.push_back(weights_.home(id));
      bytes += static_cast<int64_t>(host.back().nbytes());
    }
    if (done.size() >= 2) {
      done.front()->synchronize();
      done.erase(done.begin());
      held.erase(held.begin());
    }
    auto [copies, event] = device.upload(Queue::kParamUpload, host, nullptr, worker.staging());
    done.push_back(event);
    held.push_back(std::move(copies));
  }
  for (auto& event : done) event->synchronize();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return seconds > 0 ? static_cast<double>(bytes) / seconds : 0;
}

bool Engine::wait_for_background_work() {
  check_caller_thread("wait_for_background_work()");
  settle();
  report_failed_call();
  return optimizer_.update_pending();
}

void Engine::restore_pending_update() {
  synchronize();
  optimizer_.restore_pending_update();
}

}  // namespace roundpipe::detail

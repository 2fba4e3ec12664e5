// The RoundPipe engine: see engine.h and docs/architecture.md.
#include "runtime/engine.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <unordered_map>

#include "optim/parallel.h"
#include "roundpipe/errors.h"
#include "roundpipe/microbatch.h"
#include "roundpipe/recompute.h"
#include "runtime/allocation_meter.h"
#include "runtime/ivalue_tree.h"
#include "runtime/rng.h"
#include "runtime/schedule.h"
#include "runtime/trace.h"

namespace roundpipe::detail {

// ---------------------------------------------------------------- helpers

namespace {

// Uploads the defined tensors of `tensors`, keeping undefined ones.
std::pair<std::vector<at::Tensor>, EventPtr> upload_flat(Device& device, Queue queue,
                                                         const std::vector<at::Tensor>& tensors,
                                                         const EventPtr& after) {
  std::vector<at::Tensor> defined;
  for (const auto& t : tensors) {
    if (t.defined()) defined.push_back(t);
  }
  auto [copies, event] = device.upload(queue, defined, after);
  std::vector<at::Tensor> out;
  size_t next = 0;
  for (const auto& t : tensors) out.push_back(t.defined() ? copies[next++] : at::Tensor());
  return {out, event};
}

std::pair<std::vector<at::Tensor>, EventPtr> download_flat(Device& device,
                                                           const std::vector<at::Tensor>& tensors,
                                                           const HostAllocator& allocate) {
  std::vector<at::Tensor> defined;
  for (const auto& t : tensors) {
    if (t.defined()) defined.push_back(t.detach());
  }
  auto [copies, event] = device.download(defined, allocate);
  std::vector<at::Tensor> out;
  size_t next = 0;
  for (const auto& t : tensors) out.push_back(t.defined() ? copies[next++] : at::Tensor());
  return {out, event};
}

std::pair<c10::IValue, EventPtr> upload_value(Device& device, const c10::IValue& value,
                                              const EventPtr& after) {
  auto [tensors, event] = upload_flat(device, Queue::kActUpload, flatten_tensors(value), after);
  return {replace_tensors(value, tensors), event};
}

std::pair<c10::IValue, EventPtr> download_value(Device& device, const c10::IValue& value,
                                                const HostAllocator& allocate) {
  auto [tensors, event] = download_flat(device, flatten_tensors(value), allocate);
  return {replace_tensors(value, tensors), event};
}

// Held while the engine borrows the CPU default generator outside the
// random streams (a layer instance's initialisation; a call's seed draw),
// so that the two never interleave. Taken after a device's compute lock.
std::mutex& cpu_generator_borrow_mutex() {
  static std::mutex mu;
  return mu;
}

RngState capture_rng(Device& device, bool active) {
  RngState rng;
  rng.active = active;
  if (!active) return rng;
  auto gen = device.generator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  rng.state = gen.get_state();
  return rng;
}

void apply_rng(Device& device, const RngState& rng) {
  if (!rng.active) return;
  auto gen = device.generator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  if (rng.state.defined()) {
    gen.set_state(rng.state);
  } else {
    gen.set_current_seed(rng.seed);
  }
}

// Sets a microbatch's random stream on the device generator and restores
// the generator's own state afterwards.
class RngScope {
 public:
  RngScope(Device& device, const RngState& start) : device_(device), active_(start.active) {
    if (!active_) return;
    saved_ = capture_rng(device_, true);
    apply_rng(device_, start);
  }
  ~RngScope() {
    if (active_) apply_rng(device_, saved_);
  }
  RngState capture() { return capture_rng(device_, active_); }

 private:
  Device& device_;
  bool active_;
  RngState saved_;
};

// Where save_for_recompute() & co. find the layer call they are part of.
struct LayerCall {
  CallState* call;
  int layer;
  int microbatch;
  bool recompute;
  c10::Device device;
};
thread_local LayerCall* current_layer_call = nullptr;

struct LayerCallScope {
  LayerCall record;
  LayerCall* previous;
  LayerCallScope(CallState* call, int layer, int mb, bool recompute, c10::Device device)
      : record{call, layer, mb, recompute, device}, previous(current_layer_call) {
    current_layer_call = &record;
  }
  ~LayerCallScope() { current_layer_call = previous; }
};

}  // namespace

c10::IValue to_device(const c10::IValue& value, c10::Device device) {
  return map_tensors(value, [&](const at::Tensor& t) {
    return t.defined() && t.device() != device ? t.to(device) : t;
  });
}

namespace {

void check_devices(const c10::IValue& value, const Device& device, int layer,
                   const std::string& type_name) {
  const auto expected = device.torch_device();
  for (const auto& t : flatten_tensors(value)) {
    if (!t.defined()) continue;
    TORCH_CHECK(t.device() == expected, "layer ", layer, " (", type_name, ") returned a tensor on ",
                t.device(), " while running on ", device.name(), " (", expected,
                "). A layer's temporaries and outputs must take their device from its inputs or "
                "weights, never a fixed device.");
  }
}

// Makes the floating tensors of a stage input autograd leaves.
c10::IValue make_leaves(const c10::IValue& value, const std::vector<bool>* only,
                        std::vector<at::Tensor>& leaves) {
  size_t i = 0;
  return map_tensors(value, [&](const at::Tensor& t) {
    const size_t index = i++;
    at::Tensor leaf = t;
    if (t.defined() && at::isFloatingType(t.scalar_type()) &&
        (only == nullptr || (index < only->size() && (*only)[index]))) {
      leaf = t.detach().requires_grad_(true);
    }
    leaves.push_back(leaf);
    return leaf;
  });
}

std::vector<at::Tensor> leaf_grads(const std::vector<at::Tensor>& leaves) {
  std::vector<at::Tensor> grads;
  for (const auto& l : leaves) grads.push_back(l.requires_grad() ? l.grad() : at::Tensor());
  return grads;
}

// Back-propagates `grads` through the outputs that require grad and got one.
void backward_through(const c10::IValue& output, const std::vector<at::Tensor>& grads) {
  const auto outs = flatten_tensors(output);
  TORCH_CHECK(outs.size() == grads.size(), "the stage output holds ", outs.size(), " tensors but ",
              grads.size(), " gradients arrived for it");
  std::vector<at::Tensor> roots, root_grads;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs[i].defined() && outs[i].requires_grad() && grads[i].defined()) {
      roots.push_back(outs[i]);
      root_grads.push_back(grads[i]);
    }
  }
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);
}

}  // namespace

// ---------------------------------------------------------------- workers

// Two threads per device. The worker runs one stage job at a time, in
// dispatch order. The uploader walks the same queue and uploads each job's
// parameters as soon as memory allows: once the job two before it has left
// the device, so at most two stages' parameters are resident (one running,
// one arriving), as the plan's memory budget assumes. That host wait is the
// uploader's alone: the worker never stops enqueuing compute for it.
class Worker {
 public:
  Worker(Engine& engine, DevicePtr device) : engine_(engine), device_(std::move(device)) {
    thread_ = std::thread([this] {
      set_engine_thread(&engine_);
      device_->bind_compute_thread();
      trace_name_ = device_->name();
      trace_who = trace_name_.c_str();
      loop();
    });
    uploader_ = std::thread([this] {
      set_engine_thread(&engine_);
      device_->bind_compute_thread();
      uploader_name_ = device_->name() + " uploader";
      trace_who = uploader_name_.c_str();
      upload_loop();
    });
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    thread_.join();
    uploader_.join();
  }
  void submit(std::shared_ptr<Job> job) {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(job);
    uploads_.push_back(std::move(job));
    cv_.notify_all();
  }
  Device& device() { return *device_; }

  // Waits until the uploader has enqueued the job's parameter upload (the
  // compute queue then waits for job.params_ready on the device); rethrows
  // the upload's error.
  void wait_for_upload(Job& job) {
    const auto start = std::chrono::steady_clock::now();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return job.upload_done; });
    }
    if (ms_since(start) > 0.5)
      ROUNDPIPE_TRACE("call %lld: waited %.1f ms for the upload of %s",
                      static_cast<long long>(job.call->id), ms_since(start),
                      job.describe().c_str());
    if (job.upload_error) std::rethrow_exception(job.upload_error);
    if (!job.params_ready) throw CallAborted{};  // skipped: the call failed meanwhile
  }

 private:
  void loop() {
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
      engine_.run_job(*job, *this);
      ROUNDPIPE_TRACE("call %lld: enqueued %s", static_cast<long long>(job->call->id),
                      job->describe().c_str());
      auto end = device_->record(Queue::kCompute);
      {
        // The uploader is done with this job too (a job of an aborted call
        // returns without waiting for it): its reads can be released.
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return job->upload_done; });
        *job->end = std::move(end);
        jobs_.pop_front();
        cv_.notify_all();
      }
      engine_.job_finished(*job);
    }
  }

  void upload_loop() {
    std::deque<std::shared_ptr<EventPtr>> recent;  // ends of the (up to) two jobs before
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !uploads_.empty(); });
        if (uploads_.empty()) return;
        job = uploads_.front();
        uploads_.pop_front();
      }
      const auto start = std::chrono::steady_clock::now();
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
          upload(*job, start);
        } catch (...) {
          job->upload_error = std::current_exception();
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      job->upload_done = true;
      cv_.notify_all();
    }
  }

  void upload(Job& job, std::chrono::steady_clock::time_point start);

  Engine& engine_;
  DevicePtr device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;     // front: the running job
  std::deque<std::shared_ptr<Job>> uploads_;  // front: the next upload
  bool stop_ = false;
  std::string trace_name_, uploader_name_;
  std::thread thread_, uploader_;
  friend class Engine;
};

// ---------------------------------------------------------------- engine

namespace {

// Parameters whose homes share one storage (by data pointer, as register
// mode pins them), with the byte range of the storage their views cover.
struct HomeGroup {
  const char* base = nullptr;  // the storage's data
  int64_t begin = 0, end = 0;  // bytes from base; begin a multiple of `align`
  int64_t align = 1;           // the largest element size among the views
  std::vector<int> entries;
};

std::vector<HomeGroup> home_groups(const std::vector<ParamEntry>& params) {
  std::vector<HomeGroup> groups;
  std::unordered_map<const char*, size_t> by_base;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& home = params[i].home;
    if (home.numel() == 0) continue;
    const int64_t item = static_cast<int64_t>(home.element_size());
    const int64_t begin = home.storage_offset() * item;
    const int64_t end = static_cast<int64_t>(at::detail::computeStorageNbytes(
        home.sizes(), home.strides(), item, home.storage_offset()));
    const auto* base = static_cast<const char*>(home.storage().data());
    auto [it, inserted] = by_base.emplace(base, groups.size());
    if (inserted) groups.push_back({base, begin, end, item, {}});
    auto& group = groups[it->second];
    group.begin = std::min(group.begin, begin);
    group.end = std::max(group.end, end);
    group.align = std::max(group.align, item);
    group.entries.push_back(static_cast<int>(i));
  }
  // Element sizes are powers of two: every view's offset from an aligned
  // begin is a whole number of its elements.
  for (auto& group : groups) group.begin -= group.begin % group.align;
  return groups;
}

// Copies each group's range into one block of a chunk reserved for all of
// them and rebinds the parameters to it (views of one storage stay views of
// one block; the model's parameter tensors keep their identity).
void move_homes_into(HostArena& arena, std::vector<ParamEntry>& params,
                     const std::vector<HomeGroup>& groups) {
  int64_t total = 0;
  for (const auto& group : groups) total += arena.block_bytes(group.end - group.begin);
  arena.reserve(total);
  struct Piece {
    char* dst;
    const char* src;
    int64_t bytes;
  };
  constexpr int64_t kPiece = int64_t{64} << 20;
  std::vector<Piece> pieces;
  std::vector<c10::Storage> storages;
  for (const auto& group : groups) {
    const int64_t bytes = group.end - group.begin;
    auto block = arena.allocate(bytes);
    auto* dst = static_cast<char*>(block.get());
    for (int64_t done = 0; done < bytes; done += kPiece) {
      pieces.push_back(
          {dst + done, group.base + group.begin + done, std::min(kPiece, bytes - done)});
    }
    storages.emplace_back(c10::Storage::use_byte_size_t(), bytes, std::move(block),
                          /*allocator=*/nullptr, /*resizable=*/false);
  }
  parallel_for_each(static_cast<int64_t>(pieces.size()), [&](int64_t i) {
    std::memcpy(pieces[i].dst, pieces[i].src, static_cast<size_t>(pieces[i].bytes));
  });
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int i : groups[g].entries) {
      auto& home = params[i].home;
      const int64_t item = static_cast<int64_t>(home.element_size());
      auto moved = at::empty({0}, at::TensorOptions().dtype(home.scalar_type()));
      moved.set_(storages[g], (home.storage_offset() * item - groups[g].begin) / item, home.sizes(),
                 home.strides());
      home.set_data(moved);
    }
  }
}

}  // namespace

Engine::Engine(std::vector<LayerPtr> layers, RoundPipeOptions options)
    : name_(options.name.empty() ? "RoundPipe" : options.name),
      options_(std::move(options)),
      layers_(std::move(layers)),
      pool_(options_.device_list.empty()
                ? make_devices(options_.devices.empty() ? default_device_spec() : options_.devices)
                : options_.device_list) {
  TORCH_CHECK(!layers_.empty(), name_, ": the model has no layers; wrap a non-empty Sequential");
  // The unique parameters: tied weights are one entry shared by several layers.
  std::unordered_map<const c10::TensorImpl*, int> ids;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const auto& layer = layers_[l];
    std::vector<int> layer_ids;
    int64_t bytes = 0, grad_bytes = 0;
    const auto names = layer->parameter_names();
    const auto layer_params = layer->parameters();
    for (size_t i = 0; i < layer_params.size(); ++i) {
      const auto& p = layer_params[i];
      TORCH_CHECK(p.device().is_cpu(), name_,
                  ": parameters must be on the CPU (the model's home); ", "found one on ",
                  p.device(), " in ", layer->type_name(), ". Call .to(torch::kCPU) first.");
      auto [it, inserted] = ids.emplace(p.unsafeGetTensorImpl(), static_cast<int>(params_.size()));
      if (inserted) {
        ParamEntry entry;
        entry.home = p;
        entry.name = std::to_string(l) + "." + (i < names.size() ? names[i] : std::to_string(i));
        params_.push_back(std::move(entry));
      }
      layer_ids.push_back(it->second);
      bytes += p.nbytes();
      if (p.requires_grad()) grad_bytes += p.nbytes();
    }
    for (const auto& b : layer->buffers()) {
      TORCH_CHECK(b.device().is_cpu(), name_, ": buffers must be on the CPU; found one on ",
                  b.device(), " in ", layer->type_name());
      TORCH_CHECK(!b.requires_grad(), name_, ": a buffer of ", layer->type_name(),
                  " requires grad; buffers must not require grad (make it a parameter)");
      bytes += b.nbytes();
      has_buffers_ = true;
    }
    layer_param_ids_.push_back(std::move(layer_ids));
    layer_bytes_.push_back(bytes);
    layer_grad_bytes_.push_back(grad_bytes);
  }
  timings_ = std::make_unique<LayerTimings>(num_layers());
  // Pinned home memory makes uploads fast and truly asynchronous. alloc: the
  // homes move into the arena's first chunk, reserved at their exact size,
  // and the fused optimizer's staging copies and all downloads come from the
  // arena too (pinned where the devices support it; on simulated devices the
  // arena runs unpinned, so CI exercises the same code). register: pin the
  // existing storage in place. off: nothing is pinned.
  const bool can_pin = pool_.at(0)->supports_pinned_memory();
  auto homes = home_groups(params_);
  for (const auto& group : homes) model_state_bytes_ += group.end - group.begin;
  // Chunks for downloads and staging copies: 1/64 of the weights, within
  // [2 MiB, 256 MiB]. The arena's waste is at most about one chunk: with
  // frozen weights (little beside them to pin) a quarter, as this was,
  // pinned 1.08 x the weights; 1/64 keeps it near 1.02 x. (A larger
  // request gets a chunk of its own size.)
  host_arena_ = std::make_unique<HostArena>(
      HostArenaOptions()
          .set_chunk_bytes(
              std::clamp(model_state_bytes_ / 64, int64_t{2} << 20, int64_t{256} << 20))
          .set_pin(options_.pin_model == PinMode::kAlloc && can_pin));
  if (options_.pin_model == PinMode::kAlloc) {
    if (can_pin) {
      std::erase_if(homes, [&](const HomeGroup& group) {
        return params_[group.entries.front()].home.is_pinned();  // pinned already
      });
    }
    move_homes_into(*host_arena_, params_, homes);
    host_allocator_ = [this](at::IntArrayRef sizes, at::ScalarType dtype) {
      return host_arena_->empty(sizes, dtype);
    };
  } else if (options_.pin_model == PinMode::kRegister && can_pin) {
    std::set<void*> seen;
    for (auto& entry : params_) {
      void* data = entry.home.storage().mutable_data();
      if (entry.home.is_pinned() || !seen.insert(data).second) continue;
      if (register_host_memory(data, entry.home.storage().nbytes())) registered_.push_back(data);
    }
  }
  for (const auto& device : pool_.devices()) {
    workers_.push_back(std::make_unique<Worker>(*this, device));
  }
  free_instances_.resize(layers_.size());
  // What the smallest device has left now, before this engine's work (0:
  // unlimited), less a tenth (the driver's context, fragmentation, the
  // downloads in flight). Measured at plan time it would exclude what the
  // calls in flight hold, which the plan's stages reuse.
  for (int d = 0; d < pool_.size(); ++d) {
    const auto stats = pool_.at(d)->memory_stats();
    if (stats.budget_bytes <= 0) continue;
    const int64_t left = (stats.budget_bytes - stats.in_use_bytes) / 10 * 9;
    if (default_memory_limit_bytes_ == 0 || left < default_memory_limit_bytes_)
      default_memory_limit_bytes_ = left;
  }
  all_layers_meterable_ = std::all_of(layers_.begin(), layers_.end(),
                                      [](const LayerPtr& layer) { return layer->meterable(); });
  // The link's rate, measured now, while nothing else runs: probed later
  // (at the first plan on measured times, as it was), it ran beside the
  // first update's CPU Adam and gradient sums and measured 0.5-3 GB/s of
  // ~55 on an H200 host, which made the planner split the 1.7B and 4B
  // models into stages that one would have run faster.
  (void)upload_bytes_per_second();
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
      if (pending_publish_ >= 0) publish(pending_publish_);
    } catch (...) {
    }
  } catch (...) {
  }
  workers_.clear();
  for (void* data : registered_) unregister_host_memory(data);
}

std::vector<at::Tensor> Engine::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : params_) out.push_back(p.home);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : params_) out.emplace_back(p.name, p.home);
  return out;
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

PlanEstimate Engine::auto_plan(bool fused, int num_microbatches, int min_stages,
                               std::optional<double> memory_limit_gib,
                               std::optional<RecomputeGrain> grain) const {
  PlanRequest request;
  if (!grain) grain = default_grain();
  const PlanKey key{fused, num_microbatches, *grain};
  // The default plan's question (no constraints of the caller's own): the
  // plan in use stays unless a new one is clearly faster.
  std::optional<ExecutePlan> incumbent;
  if (min_stages == 0 && !memory_limit_gib) {
    std::lock_guard<std::mutex> lock(plan_log_mu_);
    auto it = plans_in_use_.find(key);
    if (it != plans_in_use_.end()) incumbent = it->second;
  }
  if (incumbent) request.incumbent = &*incumbent;
  // Replicated tails only once a call has shown that no layer writes its
  // buffers (or there are none); ROUNDPIPE_TAIL_REPLICAS=0 turns them off.
  static const bool replicas_enabled = [] {
    const char* v = std::getenv("ROUNDPIPE_TAIL_REPLICAS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  // (Committed read first: a call's last commit sets it after any of its
  // commits saw a write.)
  const bool committed = buffers_committed_;
  request.allow_tail_replicas =
      replicas_enabled && (committed || !has_buffers_) && !buffers_written_;
  request.num_devices = pool_.size();
  request.fused = fused;
  request.num_microbatches = num_microbatches;
  request.min_stages = min_stages;
  if (!memory_limit_gib) memory_limit_gib = options_.model_memory_limit_gib;
  if (memory_limit_gib) {
    TORCH_CHECK(*memory_limit_gib > 0, name_, ": model_memory_limit must be positive (GiB), got ",
                *memory_limit_gib);
    request.memory_limit_bytes = static_cast<int64_t>(*memory_limit_gib * (1 << 30));
  } else {
    request.memory_limit_bytes = default_memory_limit_bytes_;
  }
  request.layer_grain = *grain == RecomputeGrain::kLayer;
  // Measured times once every layer has them (with the measured upload
  // rate, in the same unit), else bytes stand in. Until what layers keep
  // for their backward is measured (or where a layer cannot be metered),
  // half the limit is held back for it.
  const bool measured = timings_->complete();
  request.activations_unmeasured = !measured || !all_layers_meterable_;
  if (!measured) return plan_stages(costs_from_bytes(layer_bytes_, layer_grad_bytes_), request);
  request.upload_bytes_per_second = upload_bytes_per_second();
  return plan_stages(timings_->costs(layer_bytes_, layer_grad_bytes_), request);
}

double Engine::upload_bytes_per_second() const {
  std::call_once(upload_probe_once_, [this] {
    // A parameter-sized upload (1-64 MiB: a layer's parameters).
    int64_t total = 0;
    for (int64_t b : layer_bytes_) total += b;
    auto& device = *pool_.at(0);
    // At most an eighth of a small device's memory (a simulated one may
    // have a few KiB).
    const int64_t budget = device.memory_stats().budget_bytes;
    const int64_t bytes = std::min<int64_t>(
        std::clamp<int64_t>(total / std::max<int64_t>(num_layers(), 1), 1 << 20, 64 << 20),
        budget > 0 ? std::max<int64_t>(budget / 8, 1) : int64_t{64} << 20);
    // Pinned as the homes are (not from the arena, which then holds the
    // model alone).
    const bool pinned = options_.pin_model != PinMode::kOff && device.supports_pinned_memory();
    auto host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
    host.zero_();
    // The copy alone, timed on its queue, the fastest of three after one
    // that pays for allocation.
    // A probe that fails leaves the rate unknown (0: uploads count as
    // free), it does not fail the engine.
    double seconds = 0;
    try {
      for (int i = 0; i < 4; ++i) {
        for (Queue q : {Queue::kCompute, Queue::kDownload, Queue::kParamUpload})
          device.record(q)->synchronize();
        auto start = device.record_timing_mark(Queue::kParamUpload);
        auto [copy, done] = device.upload(Queue::kParamUpload, {host}, nullptr);
        auto end = device.record_timing_mark(Queue::kParamUpload);
        done->synchronize();  // (rethrows a failed copy)
        const double s = device.seconds_between(start, end);
        if (i > 0) seconds = seconds > 0 ? std::min(seconds, s) : s;
      }
    } catch (const std::exception& e) {
      TORCH_WARN(name_, ": the host-to-device rate probe failed (", e.what(),
                 "); the automatic plan counts uploads as free");
      seconds = 0;
    }
    upload_bytes_per_second_ = seconds > 0 ? bytes / seconds : 0;
  });
  return upload_bytes_per_second_;
}

ExecutePlan Engine::default_plan(bool fused) const {
  return default_plan(fused, options_.model_run_config.num_microbatch.value_or(pool_.size() + 1),
                      default_grain());
}

ExecutePlan Engine::default_plan(bool fused, int n, RecomputeGrain grain) const {
  // Read before planning: timings that complete in between make this log
  // say "bytes" once more, and the next call logs the measured plan.
  const bool measured = timings_->complete();
  auto estimate = auto_plan(fused, n, 0, std::nullopt, grain);
  {
    std::lock_guard<std::mutex> lock(plan_log_mu_);
    plans_in_use_[PlanKey{fused, n, grain}] = estimate.plan;
  }
  if (options_.verbose) {
    std::lock_guard<std::mutex> lock(plan_log_mu_);
    // Logged when the plan changes, and once when timings first replace the
    // byte estimate even if the plan stays: the measured per-layer costs are
    // what a user hand-tunes from.
    const std::string key = (measured ? "measured " : "estimated ") + estimate.plan.to_string();
    auto& logged = logged_plans_[fused ? 1 : 0];
    if (logged != key) {
      logged = key;
      std::fprintf(stderr, "%s: %s plan for %d microbatches on %d device(s), costs %s\n%s%s\n",
                   name_.c_str(), fused ? "forward_backward" : "forward", n, pool_.size(),
                   measured ? "measured (seconds):" : "from parameter bytes (no timings yet):",
                   measured ? timings_->describe().c_str() : "", estimate.describe().c_str());
    }
  }
  return estimate.plan;
}

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
  if (!out.num_microbatch) out.num_microbatch = pool_.size() + 1;
  return out;
}

std::unique_ptr<LayerInstance> Engine::acquire_instance(int layer, Device& device) {
  {
    std::lock_guard<std::mutex> lock(instances_mu_);
    auto& pool = free_instances_[layer];
    if (!pool.empty()) {
      auto instance = std::move(pool.back());
      pool.pop_back();
      return instance;
    }
  }
  // Cloning a module re-runs its initialisation, which draws from the CPU
  // generator: keep that off every random stream (sim compute shares it)
  // and off a new call's seed draw (calls overlap with these workers).
  auto lock = device.compute_lock();
  std::lock_guard<std::mutex> borrow(cpu_generator_borrow_mutex());
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> g(gen.mutex());
    saved = gen.get_state();
  }
  auto instance = layers_[layer]->make_instance();
  {
    std::lock_guard<std::mutex> g(gen.mutex());
    gen.set_state(saved);
  }
  return instance;
}

void Engine::release_instance(int layer, std::unique_ptr<LayerInstance> instance) {
  instance->unbind();
  std::lock_guard<std::mutex> lock(instances_mu_);
  free_instances_[layer].push_back(std::move(instance));
}

void Engine::job_finished(Job& job) {
  release_reads(job);
  if (!job.commit_posted) commits_.settle(job.commit_layers, job.call->id);
  job.call->end_work();
  std::lock_guard<std::mutex> lock(inflight_mu_);
  --inflight_;
  inflight_cv_.notify_all();
}

void Engine::release_reads(Job& job) {
  if (job.reads_released) return;
  job.reads_released = true;
  std::lock_guard<std::mutex> lock(versions_mu_);
  for (int id : job.param_ids) --params_[id].reads[job.call->weights_version];
  versions_cv_.notify_all();
}

bool Engine::weights_available(const ParamEntry& entry, int64_t version) {
  // A frozen parameter is never updated: every version is its home.
  return entry.published >= version || entry.staged_version == version ||
         !entry.home.requires_grad();
}

std::vector<at::Tensor> Engine::weights_to_upload(const Job& job) {
  std::lock_guard<std::mutex> lock(versions_mu_);
  std::vector<at::Tensor> host;
  for (int id : job.param_ids) {
    const auto& entry = params_[id];
    const bool staged = entry.published < job.call->weights_version &&
                        entry.staged_version == job.call->weights_version;
    host.push_back(staged ? entry.staging : entry.home);
  }
  return host;
}

bool Engine::wait_params_published(const Job& job) {
  const auto start = std::chrono::steady_clock::now();
  bool available = false;
  {
    std::unique_lock<std::mutex> lock(versions_mu_);
    // A failing call wakes this wait (Note [Call cancellation]).
    versions_cv_.wait(lock, [&] {
      available = std::all_of(job.param_ids.begin(), job.param_ids.end(), [&](int id) {
        return weights_available(params_[id], job.call->weights_version);
      });
      return available || job.call->aborted.load();
    });
  }
  add_seconds(&PipelineStats::weight_wait_seconds, start);
  return available;
}

void Engine::add_seconds(double PipelineStats::*field,
                         std::chrono::steady_clock::time_point start) {
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.*field += seconds;
}

void Engine::wait_for_jobs() {
  std::unique_lock<std::mutex> lock(inflight_mu_);
  inflight_cv_.wait(lock, [&] { return inflight_ == 0; });
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

void Engine::wait_for_earlier_commits(const Job& job) {
  const auto start = std::chrono::steady_clock::now();
  // A failing call wakes this wait (Note [Call cancellation]).
  if (!commits_.wait_for_earlier(
          job.commit_layers, job.call->id, [&] { return job.call->aborted.load(); }, name_)) {
    throw CallAborted{};
  }
  if (ms_since(start) > 0.5)
    ROUNDPIPE_TRACE("call %lld: waited %.1f ms for earlier calls' buffer commits",
                    static_cast<long long>(job.call->id), ms_since(start));
}

void Engine::update_as_gradients_arrive(
    std::vector<std::shared_ptr<CallState>> calls, int64_t pending_version,
    const std::function<void(std::map<int, at::Tensor>&)>& update) {
  std::set<int> left;
  for (size_t id = 0; id < params_.size(); ++id) {
    if (params_[id].master.defined()) left.insert(static_cast<int>(id));
  }
  std::vector<CallGradients*> call_grads;
  for (const auto& call : calls) call_grads.push_back(&call->grads);
  auto failed = [&] {
    return std::any_of(calls.begin(), calls.end(), [](const auto& c) { return c->aborted.load(); });
  };
  while (!left.empty()) {
    // A failing call wakes the wait (Note [Call cancellation]); the failure
    // is reported below.
    const auto ready = grads_.wait_final(call_grads, left, failed);
    if (ready.empty()) break;
    std::map<int, at::Tensor> batch;
    for (int id : ready) {
      left.erase(id);
      at::Tensor sum = grads_.sum(call_grads, id);
      // The previous update's weights go live first (once the calls that
      // read the older ones have uploaded them): the update writes over
      // the storage they leave.
      if (pending_version >= 0) publish_one(params_[id], pending_version);
      if (sum.defined()) batch[id] = sum;
    }
    if (!batch.empty()) update(batch);
  }
  if (pending_version >= 0) publish(pending_version);  // parameters without gradients
  for (const auto& call : calls) call->wait_idle();
  // A call that failed: the batches final before it failed were applied
  // (their weights go live with this update); the rest were not. (Unless
  // its error already reached the caller through autograd.)
  for (const auto& call : calls) {
    if (!call->reported) call->rethrow_if_failed();
  }
  for (auto* call : call_grads) grads_.take(*call);
}

std::map<int, at::Tensor> Engine::take_call_grads(std::vector<std::shared_ptr<CallState>> calls) {
  std::map<int, at::Tensor> grads;
  for (auto& call : calls) call->wait_idle();
  // A failed call contributes nothing; its error is thrown here unless the
  // caller already had it.
  std::erase_if(calls, [](const auto& call) { return call->reported.load(); });
  for (auto& call : calls) call->rethrow_if_failed();
  for (auto& call : calls) {
    for (auto& [id, g] : grads_.take(call->grads)) {
      auto& sum = grads[id];
      sum = sum.defined() ? sum.add_(g) : g;
    }
  }
  return grads;
}

void Engine::ensure_masters() {
  const bool missing = std::any_of(params_.begin(), params_.end(), [](const ParamEntry& e) {
    return e.home.requires_grad() && !e.master.defined();
  });
  if (!missing) return;
  optimizer_.drain();  // the homes must hold the weights the masters start from
  for (auto& entry : params_) {
    if (!entry.home.requires_grad() || entry.master.defined()) continue;
    const auto dtype = options_.optim_dtype.value_or(entry.home.scalar_type());
    entry.master = entry.home.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true);
    entry.master.requires_grad_(true);
  }
}

std::vector<at::Tensor> Engine::optim_parameters() {
  std::vector<at::Tensor> out;
  for (auto& [name, master] : optim_named_parameters()) out.push_back(master);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::optim_named_parameters() {
  ensure_masters();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& entry : params_) {
    if (entry.master.defined()) out.emplace_back(entry.name, entry.master);
  }
  return out;
}

void Engine::publish(int64_t version) {
  for (auto& entry : params_) publish_one(entry, version);
}

void Engine::publish_one(ParamEntry& entry, int64_t version) {
  {
    std::unique_lock<std::mutex> lock(versions_mu_);
    if (entry.published >= version) return;  // published already
    versions_cv_.wait(lock, [&] {
      for (const auto& [v, n] : entry.reads) {
        if (v < version && n > 0) return false;
      }
      return true;
    });
    if (entry.staged) {
      // The swap and the new version number in one step under the lock: a
      // worker picking the tensor to upload (weights_to_upload) sees either
      // the staging copy of this version or the home that now holds it,
      // never the old home in between. Its handle keeps pointing at the data.
      auto previous = entry.home.detach();
      entry.home.set_data(entry.staging);
      entry.staging = previous;  // reused by the next fused async step
      entry.staged = false;
      entry.staged_version = -1;
      mark_published(entry, version);
      return;
    }
  }
  if (entry.master.defined()) {
    c10::NoGradGuard no_grad;
    entry.home.copy_(entry.master);
  }
  std::lock_guard<std::mutex> lock(versions_mu_);
  mark_published(entry, version);
}

void Engine::mark_published(ParamEntry& entry, int64_t version) {
  entry.published = version;
  std::erase_if(entry.reads, [&](const auto& r) { return r.first < version && r.second == 0; });
  versions_cv_.notify_all();
}

void Engine::publish_version_only(int64_t version) {
  std::lock_guard<std::mutex> lock(versions_mu_);
  for (auto& entry : params_) entry.published = version;
  versions_cv_.notify_all();
}

void Engine::step(std::function<void()> step_fn, bool is_async) {
  check_caller_thread("step()");
  TORCH_CHECK(step_fn, name_, ": step() needs a step function");
  queue_step(
      [this, step_fn = std::move(step_fn)](std::map<int, at::Tensor>& grads) {
        for (auto& [id, g] : grads) {
          auto& master = params_[id].master;
          if (!master.defined()) continue;
          auto& grad = master.mutable_grad();
          grad = grad.defined() ? grad.add_(g.to(master.scalar_type()))
                                : g.to(master.scalar_type(), false, /*copy=*/true);
        }
        step_fn();
      },
      is_async, /*fused=*/false, /*piecewise=*/false);
}

void Engine::step_fused(optim::Adam& adam, bool is_async, optim::GradScaler* scaler) {
  check_caller_thread("step()");
  queue_step(
      [this, &adam, is_async, scaler](std::map<int, at::Tensor>& grads) {
        std::vector<at::Tensor> masters, lowp_grads, outs;
        for (auto& [id, g] : grads) {
          auto& entry = params_[id];
          if (!entry.master.defined()) continue;
          masters.push_back(entry.master);
          lowp_grads.push_back(g);
          if (is_async) {
            // The next calls still read the current weights: write the new
            // ones aside, publish() swaps them in.
            if (!entry.staging.defined()) {
              if (host_allocator_) {  // alloc mode: from the arena
                entry.staging = host_allocator_(entry.home.sizes(), entry.home.scalar_type());
              } else {
                entry.staging = at::empty_like(entry.home, at::MemoryFormat::Contiguous);
                if (entry.home.is_pinned()) entry.staging = entry.staging.pin_memory();
              }
            }
            entry.staged = true;
            outs.push_back(entry.staging);
          } else {
            outs.push_back(entry.home);  // sync: no call runs, write in place
          }
        }
        auto update = [&] { adam.fused_step(masters, lowp_grads, outs); };
        if (scaler == nullptr) {
          update();
        } else if (!scaler->step(lowp_grads, update)) {
          for (auto& [id, g] : grads)
            params_[id].staged = false;  // skipped: nothing new to publish
        }
      },
      is_async, /*fused=*/true,
      // Parameter by parameter as gradients arrive, unless a scaler must
      // first see every gradient (a sync step has nothing to overlap).
      /*piecewise=*/is_async && scaler == nullptr);
}

void Engine::queue_step(std::function<void(std::map<int, at::Tensor>&)> update_masters,
                        bool is_async, bool fused, bool piecewise) {
  optimizer_.rethrow_failure();
  ensure_masters();
  auto calls = std::move(unconsumed_calls_);
  unconsumed_calls_.clear();
  const int64_t update = updates_++;
  // Async: the next calls run on the weights of the update before this one
  // (one step of staleness); sync: on this step's result.
  version_for_new_calls_ = is_async ? update : update + 1;
  optimizer_.post(
      nullptr, [this, calls = std::move(calls), update_masters = std::move(update_masters), update,
                is_async, fused, piecewise]() mutable {
        using Clock = std::chrono::steady_clock;
        trace_who = "optimizer";
        auto start = Clock::now();
        if (piecewise) {
          // Each batch of final gradients is applied while the calls'
          // shallower stages still run, and its staged weights are
          // available at once to calls that read this update's version.
          double updating = 0;
          std::exception_ptr error;
          try {
            update_as_gradients_arrive(std::move(calls), pending_publish_,
                                       [&](std::map<int, at::Tensor>& batch) {
                                         const auto batch_start = Clock::now();
                                         update_masters(batch);
                                         std::lock_guard<std::mutex> lock(versions_mu_);
                                         for (auto& [id, g] : batch) {
                                           if (params_[id].staged)
                                             params_[id].staged_version = update + 1;
                                         }
                                         versions_cv_.notify_all();
                                         updating += ms_since(batch_start) / 1000;
                                       });
          } catch (...) {
            error = std::current_exception();
            if (pending_publish_ >= 0) publish(pending_publish_);
          }
          pending_publish_ = update + 1;
          const double total = ms_since(start) / 1000;
          ROUNDPIPE_TRACE("update %lld: done piecewise (%.1f ms updating in %.1f ms)",
                          static_cast<long long>(update), updating * 1000, total * 1000);
          {
            std::lock_guard<std::mutex> lock(stats_mu_);
            stats_.optimizer_update_seconds += updating;
            stats_.optimizer_grad_wait_seconds += total - updating;
            ++stats_.optimizer_updates;
          }
          if (error) std::rethrow_exception(error);
          return;
        }
        if (pending_publish_ >= 0) {
          publish(pending_publish_);  // the previous update, now that its readers are known
          ROUNDPIPE_TRACE("published v%lld (%.1f ms)", static_cast<long long>(pending_publish_),
                          ms_since(start));
          pending_publish_ = -1;
          add_seconds(&PipelineStats::optimizer_publish_seconds, start);
        }
        start = Clock::now();
        auto grads = take_call_grads(std::move(calls));
        ROUNDPIPE_TRACE("update %lld: gradients ready after %.1f ms",
                        static_cast<long long>(update), ms_since(start));
        add_seconds(&PipelineStats::optimizer_grad_wait_seconds, start);
        // Calls already wait for this version: publish it even when the update
        // throws (the masters hold whatever it left), then report.
        std::exception_ptr error;
        start = Clock::now();
        try {
          update_masters(grads);
        } catch (...) {
          error = std::current_exception();
        }
        if (is_async && fused && !error) {
          // The staged weights are written: calls that read this version
          // may upload them from the staging copies before publish().
          std::lock_guard<std::mutex> lock(versions_mu_);
          for (auto& entry : params_) {
            if (entry.staged) entry.staged_version = update + 1;
          }
          versions_cv_.notify_all();
        }
        ROUNDPIPE_TRACE("update %lld: done in %.1f ms", static_cast<long long>(update),
                        ms_since(start));
        add_seconds(&PipelineStats::optimizer_update_seconds, start);
        start = Clock::now();
        if (is_async) {
          pending_publish_ = update + 1;
        } else if (fused) {
          publish_version_only(update + 1);  // the fused pass wrote the weights
        } else {
          publish(update + 1);
        }
        add_seconds(&PipelineStats::optimizer_publish_seconds, start);
        {
          std::lock_guard<std::mutex> lock(stats_mu_);
          ++stats_.optimizer_updates;
        }
        if (error) std::rethrow_exception(error);
      });
  if (!is_async) optimizer_.drain();
}

std::vector<ScheduledJob> Engine::schedule(const CallState& call, CallPhase phase) {
  // The jobs take consecutive turns of the pool's round-robin, carried
  // across calls: reserve as many turns as the phase has jobs.
  const int devices = pool_.size();
  const auto turns = static_cast<int>(schedule_call(call.plan, phase, devices, 0, call.n).size());
  return schedule_call(call.plan, phase, devices, pool_.take(turns), call.n);
}

void Engine::dispatch(const std::shared_ptr<CallState>& call, const ScheduledJob& scheduled) {
  auto job = std::make_shared<Job>();
  static_cast<ScheduledJob&>(*job) = scheduled;
  job->call = call;
  const auto& range = scheduled.range;
  const auto kind = scheduled.kind;
  std::set<int> seen;
  for (int l = range.begin; l < range.end; ++l) {
    for (int id : layer_param_ids_[l]) {
      if (seen.insert(id).second) job->param_ids.push_back(id);
    }
  }
  {
    std::lock_guard<std::mutex> lock(versions_mu_);
    for (int id : job->param_ids) ++params_[id].reads[call->weights_version];
  }
  if (kind != JobKind::kForward && call->training) {
    std::vector<int> trainable;
    for (int id : job->param_ids) {
      if (params_[id].home.requires_grad()) trainable.push_back(id);
    }
    grads_.expect(call->grads, trainable);
  }
  if (kind != JobKind::kBackward) {
    // Later calls' forwards of these layers read the buffers it commits.
    for (int l = range.begin; l < range.end; ++l) {
      if (!layers_[l]->buffers().empty()) job->commit_layers.push_back(l);
    }
    commits_.expect(job->commit_layers, call->id);
    if (!job->commit_layers.empty()) ++call->commits_left;
  }
  call->begin_work();
  {
    std::lock_guard<std::mutex> lock(inflight_mu_);
    ++inflight_;
  }
  workers_[scheduled.device]->submit(std::move(job));
}

void Worker::upload(Job& job, std::chrono::steady_clock::time_point start) {
  auto& engine = engine_;
  if (!engine.wait_params_published(job)) return;  // the call failed: nothing to run
  const auto host = engine.weights_to_upload(job);
  auto [copies, event] = device_->upload(Queue::kParamUpload, host, nullptr);
  ROUNDPIPE_TRACE("call %lld: parameter upload of %s enqueued (after %.1f ms)",
                  static_cast<long long>(job.call->id), job.describe().c_str(), ms_since(start));
  job.device_params = std::move(copies);
  job.params_ready = event;
  // Once the copies have read the home tensors, the optimizer may publish.
  job.reads_released = true;
  engine.host_tasks_.post(event,
                          [&engine, ids = job.param_ids, version = job.call->weights_version] {
                            std::lock_guard<std::mutex> lock(engine.versions_mu_);
                            for (int id : ids) --engine.params_[id].reads[version];
                            engine.versions_cv_.notify_all();
                          });
}

// ---------------------------------------------------------------- stage jobs

// Runs one stage job on one device; keeps the progress for error messages.
struct StageRunner {
  Engine& engine;
  Job& job;
  Worker& worker;
  Device& device;
  CallState& call;
  int layer = -1;
  int microbatch = -1;
  const char* phase = "start";
  std::map<int, std::unique_ptr<LayerInstance>> instances;
  bool buffers_bound = false;
  EventPtr buffers_ready;
  // Compute intervals of this microbatch, measured on the host-task thread
  // once the last one has completed (feeds the automatic plan).
  struct Interval {
    int layer;  // -1: the whole stage's backward, shared by its layers
    LayerTimings::Kind kind;
    EventPtr start, end;
  };
  std::vector<Interval> intervals;

  StageRunner(Engine& e, Job& j, Worker& w)
      : engine(e), job(j), worker(w), device(w.device()), call(*j.call) {}

  EventPtr mark() { return device.record_timing_mark(); }

  // Hands this microbatch's intervals to the host-task thread. A stage's
  // backward without per-layer marks is shared by its layers in proportion
  // to their recompute (or forward) times.
  void flush_timings() {
    if (intervals.empty()) return;
    auto measured = std::move(intervals);
    intervals.clear();
    auto* timings = engine.timings_.get();
    Device* dev = &device;
    const LayerRange range = job.range;
    engine.host_tasks_.post(measured.back().end, [measured, timings, dev, range] {
      std::map<int, double> recompute;
      double stage_backward = -1;
      for (const auto& i : measured) {
        const double s = dev->seconds_between(i.start, i.end);
        if (i.layer < 0) {
          stage_backward = s;
          continue;
        }
        timings->add(i.layer, i.kind, s);
        if (i.kind != LayerTimings::kBackward) recompute[i.layer] += s;
      }
      if (stage_backward < 0) return;
      double total = 0;
      for (int l = range.begin; l < range.end; ++l) total += recompute[l];
      for (int l = range.begin; l < range.end; ++l) {
        const double share = total > 0 ? recompute[l] / total : 1.0 / range.size();
        timings->add(l, LayerTimings::kBackward, stage_backward * share);
      }
    });
  }

  ~StageRunner() {
    for (auto& [l, instance] : instances) engine.release_instance(l, std::move(instance));
  }

  void run() {
    phase = "parameter upload";
    worker.wait_for_upload(job);
    const auto start = std::chrono::steady_clock::now();
    for (int l = job.range.begin; l < job.range.end; ++l) {
      instances[l] = engine.acquire_instance(l, device);
    }
    if (ms_since(start) > 0.5)
      ROUNDPIPE_TRACE("call %lld: layer instances took %.1f ms", static_cast<long long>(call.id),
                      ms_since(start));
    if (job.kind == JobKind::kForward) run_forward();
    if (job.kind == JobKind::kBackward) run_backward();
    if (job.kind == JobKind::kTail) run_tail();
    layer = -1;
    microbatch = -1;
    // Buffer commits first: a next call's forward of these layers waits
    // for them, not for the gradients.
    if (job.kind != JobKind::kBackward) commit_buffers();
    if (job.kind != JobKind::kForward) download_param_grads();
  }

  // Binds the stage's parameters and buffers (home buffers, or for a
  // recompute the snapshot taken before the forward's first microbatch).
  void bind_instances() {
    if (buffers_bound) return;
    phase = "buffer commit of an earlier call";
    if (job.kind != JobKind::kBackward) engine.wait_for_earlier_commits(job);
    phase = "parameter upload";
    std::unordered_map<int, at::Tensor> by_id;
    for (size_t i = 0; i < job.param_ids.size(); ++i)
      by_id[job.param_ids[i]] = job.device_params[i];
    std::vector<at::Tensor> host_buffers;
    std::vector<size_t> counts;
    for (int l = job.range.begin; l < job.range.end; ++l) {
      std::vector<at::Tensor> buffers = engine.layers_[l]->buffers();
      if (job.kind == JobKind::kBackward && !buffers.empty()) {
        std::lock_guard<std::mutex> lock(call.buffers_mu);
        auto it = call.buffer_snapshot.find(l);
        TORCH_CHECK(it != call.buffer_snapshot.end(), "no buffer snapshot for layer ", l);
        buffers = it->second;
      } else if (job.kind == JobKind::kForward && call.training && !buffers.empty()) {
        std::vector<at::Tensor> snapshot;
        for (const auto& b : buffers) snapshot.push_back(b.clone());
        std::lock_guard<std::mutex> lock(call.buffers_mu);
        call.buffer_snapshot[l] = std::move(snapshot);
      }
      counts.push_back(buffers.size());
      host_buffers.insert(host_buffers.end(), buffers.begin(), buffers.end());
    }
    // On the activation queue: the parameter queue may already carry the
    // next job's upload, which this job's compute must not wait for.
    auto [device_buffers, event] = device.upload(Queue::kActUpload, host_buffers, nullptr);
    buffers_ready = event;
    size_t next = 0;
    for (int l = job.range.begin; l < job.range.end; ++l) {
      std::vector<at::Tensor> params, buffers;
      std::vector<bool> requires_grad;
      for (int id : engine.layer_param_ids_[l]) {
        params.push_back(by_id.at(id));
        requires_grad.push_back(job.kind != JobKind::kForward &&
                                engine.params_[id].home.requires_grad());
      }
      const size_t count = counts[l - job.range.begin];
      buffers.assign(device_buffers.begin() + next, device_buffers.begin() + next + count);
      next += count;
      instances[l]->bind(params, requires_grad, buffers, engine.layers_[l]->is_training());
    }
    device.wait(Queue::kCompute, job.params_ready);
    device.wait(Queue::kCompute, buffers_ready);
    buffers_bound = true;
  }

  c10::IValue run_layer(int l, const c10::IValue& x, bool recompute) {
    layer = l;
    phase = recompute ? "recompute" : "forward";
    LayerCallScope scope(&call, l, microbatch, recompute, device.torch_device());
    const bool with_grad = c10::GradMode::is_enabled();
    // The first few forwards with grad are metered: what the layer still
    // holds after one is what it keeps for its backward (the planner's
    // activation memory).
    std::optional<MeterScope> metering;
    if (with_grad && engine.layers_[l]->meterable() && engine.timings_->wants_kept_bytes(l))
      metering.emplace();
    auto start = mark();
    auto y = instances[l]->forward(x);
    const int64_t kept = metering && metering->meter() ? metering->meter()->net_bytes() : -1;
    metering.reset();
    intervals.push_back(
        {l, with_grad ? LayerTimings::kRecompute : LayerTimings::kForward, start, mark()});
    check_devices(y, device, l, engine.layers_[l]->type_name());
    int64_t bytes = 0;
    for (const auto& t : flatten_tensors(y)) bytes += t.defined() ? t.nbytes() : 0;
    engine.timings_->add_output_bytes(l, bytes);
    if (kept >= 0) engine.timings_->add_kept_bytes(l, kept, bytes);
    return y;
  }

  // Input of the stage for microbatch m, uploaded and waited for by compute.
  c10::IValue load_input(Slot& slot) {
    phase = "activation upload";
    auto [x, event] = upload_value(device, slot.value, slot.event);
    bind_instances();
    device.wait(Queue::kCompute, event);
    return x;
  }

  void run_forward() {
    const auto& r = job.range;
    for (int m = 0; m < call.n; ++m) {
      microbatch = m;
      Slot& in = call.wait(call.act.at(r.begin)[m]);
      auto x = load_input(in);
      RngState out_rng;
      {
        auto lock = device.compute_lock();
        RngScope rng(device, in.rng);
        c10::NoGradGuard no_grad;
        for (int l = r.begin; l < r.end; ++l) {
          if (l > r.begin && call.act.count(l)) {
            phase = "download";
            auto [saved, event] = download_value(device, x, engine.host_allocator_);
            CallState::put(*call.act.at(l)[m], saved, {}, event, rng.capture());
          }
          x = run_layer(l, x, false);
        }
        out_rng = rng.capture();
      }
      layer = -1;
      phase = "download";
      auto [out, event] = download_value(device, x, engine.host_allocator_);
      CallState::put(*call.act.at(r.end)[m], out, {}, event, out_rng);
      flush_timings();
    }
  }

  // Gradient of the stage output for microbatch m, on this device.
  std::vector<at::Tensor> load_grad(int boundary, int m) {
    Slot& g = call.wait(call.grad.at(boundary)[m]);
    phase = "activation upload";
    auto [grads, event] = upload_flat(device, Queue::kActUpload, g.tensors, g.event);
    device.wait(Queue::kCompute, event);
    return grads;
  }

  // Makes the stage input's float tensors leaves; at layer 0 only the
  // caller's tensors that require grad.
  c10::IValue input_leaves(const c10::IValue& x, int l, int m, std::vector<at::Tensor>& leaves) {
    if (l > 0) return make_leaves(x, nullptr, leaves);
    const auto only = call.microbatch_input_requires_grad(m);
    return make_leaves(x, &only, leaves);
  }

  void send_input_grads(int l, int m, const std::vector<at::Tensor>& leaves) {
    phase = "download";
    auto grads = leaf_grads(leaves);
    auto [host, event] = download_flat(device, grads, engine.host_allocator_);
    if (l > 0) {
      CallState::put(*call.grad.at(l)[m], {}, host, event, {});
    } else if (call.training && !call.fused) {
      event->synchronize();
      call.input_grads[m] = host;
    }
  }

  void run_backward() {
    const auto& r = job.range;
    const bool layer_grain = call.grain == RecomputeGrain::kLayer;
    for (int m = 0; m < call.n; ++m) {
      microbatch = m;
      auto grads = load_grad(r.end, m);
      std::vector<at::Tensor> leaves;
      if (layer_grain) {
        for (int l = r.end - 1; l >= r.begin; --l) {
          Slot& in = call.wait(call.act.at(l)[m]);
          auto x = load_input(in);
          leaves.clear();
          auto lock = device.compute_lock();
          RngScope rng(device, in.rng);
          c10::AutoGradMode grad_mode(true);
          x = input_leaves(x, l, m, leaves);
          auto y = run_layer(l, x, true);
          phase = "backward";
          auto start = mark();
          backward_through(y, grads);
          intervals.push_back({l, LayerTimings::kBackward, start, mark()});
          grads = leaf_grads(leaves);
        }
      } else {
        Slot& in = call.wait(call.act.at(r.begin)[m]);
        auto x = load_input(in);
        auto lock = device.compute_lock();
        RngScope rng(device, in.rng);
        c10::AutoGradMode grad_mode(true);
        x = input_leaves(x, r.begin, m, leaves);
        for (int l = r.begin; l < r.end; ++l) x = run_layer(l, x, true);
        phase = "backward";
        layer = -1;
        auto start = mark();
        backward_through(x, grads);
        intervals.push_back({-1, LayerTimings::kBackward, start, mark()});
      }
      layer = -1;
      flush_timings();
      send_input_grads(r.begin, m, leaves);
    }
  }

  // A layer's input kept for its recompute: on the host, with the random
  // state the layer started from. Local to one microbatch of the tail (the
  // call's slots would hold every microbatch's inputs until the call ends).
  struct SavedInput {
    c10::IValue value;
    EventPtr event;
    RngState rng;
  };

  void run_tail() {
    const auto& r = job.range;
    // Layer grain holds one layer's activations at a time here too: a pass
    // without grad saves each layer's input to the host, then the last
    // layer and the loss run with grad, and each earlier layer is recomputed
    // and backpropagated, last first (as run_backward does across stages).
    const bool layer_grain = call.grain == RecomputeGrain::kLayer && r.end - r.begin > 1;
    const int first_with_grad = layer_grain ? r.end - 1 : r.begin;
    for (int m = job.replica; m < call.n; m += job.replicas) {
      microbatch = m;
      Slot& in = call.wait(call.act.at(r.begin)[m]);
      auto x = load_input(in);
      phase = "activation upload";
      auto [label, label_event] = upload_value(device, call.labels[m], nullptr);
      device.wait(Queue::kCompute, label_event);
      std::vector<at::Tensor> leaves;
      at::Tensor loss;
      {
        auto lock = device.compute_lock();
        RngScope rng(device, in.rng);
        std::vector<SavedInput> saved;
        if (layer_grain) {
          c10::NoGradGuard no_grad;
          for (int l = r.begin; l < first_with_grad; ++l) {
            phase = "download";
            auto [value, event] = download_value(device, x, engine.host_allocator_);
            saved.push_back({value, event, rng.capture()});
            x = run_layer(l, x, false);
          }
        }
        c10::AutoGradMode grad_mode(true);
        std::vector<bool> none;
        x = make_leaves(x, first_with_grad == 0 ? &none : nullptr, leaves);
        for (int l = first_with_grad; l < r.end; ++l) x = run_layer(l, x, false);
        layer = -1;
        phase = "loss";
        loss = call.loss_fn(x, label);
        TORCH_CHECK(loss.defined() && loss.numel() == 1, "loss_fn must return a single-element ",
                    "loss tensor, got ", loss.defined() ? loss.sizes() : at::IntArrayRef{});
        TORCH_CHECK(loss.device() == device.torch_device(), "loss_fn returned a loss on ",
                    loss.device(), " while running on ", device.name());
        // The loss (and output) go back before the backward is enqueued:
        // the caller has them, and may issue the next call, while this
        // microbatch's backward still runs.
        phase = "download";
        auto [host_loss, loss_event] =
            download_flat(device, {loss.detach().reshape({})}, engine.host_allocator_);
        CallState::put(*call.losses[m], {}, host_loss, loss_event, {});
        if (call.return_outputs) {
          auto [out, event] = download_value(
              device,
              map_tensors(x, [](const at::Tensor& t) { return t.defined() ? t.detach() : t; }),
              engine.host_allocator_);
          CallState::put(*call.outputs[m], out, {}, event, {});
        }
        phase = "backward";
        auto start = mark();
        if (loss.requires_grad()) torch::autograd::backward({loss.reshape({})});
        intervals.push_back({-1, LayerTimings::kBackward, start, mark()});
        for (int l = first_with_grad - 1; l >= r.begin; --l) {
          auto grads = leaf_grads(leaves);
          const auto& s = saved[l - r.begin];
          phase = "activation upload";
          auto [input, event] = upload_value(device, s.value, s.event);
          device.wait(Queue::kCompute, event);
          apply_rng(device, s.rng);  // the scope restores the generator after
          leaves.clear();
          // The pass without grad made this layer's buffer writes already:
          // the recompute's are undone (after backward, which may read them).
          std::vector<at::Tensor> kept;
          for (const auto& b : instances[l]->buffer_values()) kept.push_back(b.clone());
          auto y = run_layer(l, make_leaves(input, l == 0 ? &none : nullptr, leaves), true);
          phase = "backward";
          start = mark();
          backward_through(y, grads);
          intervals.push_back({l, LayerTimings::kBackward, start, mark()});
          c10::NoGradGuard no_grad;
          auto now = instances[l]->buffer_values();
          for (size_t i = 0; i < kept.size(); ++i) now[i].copy_(kept[i]);
        }
      }
      flush_timings();
      if (r.begin > 0) send_input_grads(r.begin, m, leaves);
    }
  }

  // Sums each unique parameter's gradient over the stage's layers (a tied
  // weight used twice in one stage counts once per use, never twice per use)
  // and adds it to the parameter's CPU accumulator.
  void download_param_grads() {
    phase = "download";
    std::unordered_map<int, at::Tensor> sums;
    for (int l = job.range.begin; l < job.range.end; ++l) {
      auto leaves = instances[l]->parameter_leaves();
      const auto& ids = engine.layer_param_ids_[l];
      for (size_t j = 0; j < ids.size(); ++j) {
        const auto& g = leaves[j].grad();
        if (!g.defined()) continue;
        auto& sum = sums[ids[j]];
        sum = sum.defined() ? sum + g : g;
      }
    }
    std::vector<int> ids;
    std::vector<at::Tensor> grads;
    for (auto& [id, g] : sums) {
      ids.push_back(id);
      grads.push_back(g);
    }
    if (grads.empty()) {
      engine.grads_.delivered(job.call->grads, job.param_ids);
      return;
    }
    auto [host, event] = device.download(grads, engine.host_allocator_);
    job.call->begin_work();
    const int replica = job.replicas > 1 ? job.replica : -1;
    // The event is waited for inside the task: a failure fails the call
    // (with its context) instead of leaving the optimizer waiting for
    // gradients that never come.
    engine.grad_tasks_.post(nullptr, [&engine = engine, call = job.call, ids, host, replica, event,
                                      delivered = job.param_ids, stage = job.describe(),
                                      where = device.name(), name = engine.name_] {
      try {
        event->synchronize();
        for (size_t i = 0; i < ids.size(); ++i)
          engine.grads_.add(call->grads, ids[i], replica, host[i]);
        engine.grads_.delivered(call->grads, delivered);
      } catch (const std::exception& e) {
        call->fail(StageError(
            name + ": " + stage + " failed on " + where + ", phase gradient download: " + e.what(),
            stage, -1, -1, "gradient download", where, false, std::current_exception()));
      }
      call->end_work();
    });
  }

  // A forward commits the buffer writes of its layers once, after its last
  // microbatch (the fused tail too: it is a forward of its layers).
  void commit_buffers() {
    if (!buffers_bound) return;
    phase = "download";
    std::vector<at::Tensor> device_buffers, homes;
    for (int l = job.range.begin; l < job.range.end; ++l) {
      auto values = instances[l]->buffer_values();
      auto home = engine.layers_[l]->buffers();
      device_buffers.insert(device_buffers.end(), values.begin(), values.end());
      homes.insert(homes.end(), home.begin(), home.end());
    }
    if (device_buffers.empty()) return;
    auto [host, event] = device.download(device_buffers, engine.host_allocator_);
    job.call->begin_work();
    job.commit_posted = true;
    // The event is waited for inside the task: whatever fails (the copy,
    // the device), the commit is settled and the call's work ends, and a
    // failure stops later calls from reading half-committed buffers.
    engine.host_tasks_.post(nullptr, [&engine = engine, call = job.call, homes, host, event,
                                      layers = job.commit_layers] {
      struct Settle {
        Engine& engine;
        CallState& call;
        const std::vector<int>& layers;
        bool ok = false;
        ~Settle() {
          engine.commits_.settle(layers, call.id, ok);
          call.end_work();
        }
      } settle{engine, *call, layers};
      try {
        event->synchronize();
        for (size_t i = 0; i < homes.size(); ++i) {
          TORCH_CHECK(homes[i].sizes() == host[i].sizes(), "a buffer of shape ", homes[i].sizes(),
                      " came back as ", host[i].sizes(),
                      ": a layer may write its buffers' values, not replace them by tensors "
                      "of another shape");
          // Seen once, a buffer write rules out replicated tails (their
          // commits would race).
          if (!engine.buffers_written_ && !homes[i].equal(host[i])) engine.buffers_written_ = true;
          homes[i].copy_(host[i]);
        }
      } catch (const std::exception& e) {
        std::ostringstream what;
        what << engine.name_ << ": the buffer commit of layers";
        for (int l : layers) what << " " << l;
        what << " (call " << call->id << ") failed: " << e.what();
        throw std::runtime_error(what.str());
      }
      // Once all of a training call's commits have landed (eval mode may
      // not write), with no write seen, replicated tails may run.
      if (--call->commits_left == 0 && call->training) engine.buffers_committed_ = true;
      settle.ok = true;
    });
  }
};

void Engine::run_job(Job& job, Worker& worker) {
  auto& call = *job.call;
  if (call.aborted) return;
  StageRunner runner(*this, job, worker);
  auto fail = [&](const std::string& what, bool oom) {
    std::ostringstream msg;
    msg << name_ << ": " << job.describe() << " failed on " << worker.device().name();
    if (runner.layer >= 0) {
      msg << " in layer " << runner.layer << " (" << layers_[runner.layer]->type_name() << ")";
    }
    if (runner.microbatch >= 0) msg << ", microbatch " << runner.microbatch;
    msg << ", phase " << runner.phase << ": " << what;
    call.fail(StageError(msg.str(), job.describe(), runner.layer, runner.microbatch, runner.phase,
                         worker.device().name(), oom, std::current_exception()));
  };
  try {
    runner.run();
  } catch (const CallAborted&) {
  } catch (const c10::OutOfMemoryError& e) {
    fail(e.what_without_backtrace(), true);
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace(), false);
  } catch (const std::exception& e) {
    fail(e.what(), false);
  } catch (...) {
    fail("unknown exception", false);
  }
  job.device_params.clear();
}

// ---------------------------------------------------------------- calls

std::shared_ptr<CallState> Engine::start_call(const c10::IValue& input, const RunConfig& config,
                                              bool fused, bool training) {
  const auto start = std::chrono::steady_clock::now();
  check_earlier_calls();
  add_seconds(&PipelineStats::call_start_wait_seconds, start);
  auto call = std::make_shared<CallState>();
  // Every engine wait that may wait on this call (Note [Call cancellation]).
  call->wakers.push_back([this] { commits_.wake(); });
  call->wakers.push_back([this] { grads_.wake(); });
  call->wakers.push_back([this] {
    { std::lock_guard<std::mutex> lock(versions_mu_); }
    versions_cv_.notify_all();
  });
  call->config = resolve(config);
  call->fused = fused;
  call->training = training;
  call->n = *call->config.num_microbatch;
  call->grain = *call->config.recompute_grain;
  call->preserve_rng = *call->config.preserve_rng_state;
  call->weights_version = version_for_new_calls_;
  call->id = calls_started_++;
  ROUNDPIPE_TRACE("call %lld: starts after %.1f ms waiting for earlier calls, reads weights v%lld",
                  static_cast<long long>(call->id), ms_since(start),
                  static_cast<long long>(call->weights_version));
  TORCH_CHECK(call->n >= 1, name_, ": num_microbatch must be at least 1, got ", call->n);
  call->plan = call->config.execute_plan ? *call->config.execute_plan
                                         : default_plan(fused, call->n, call->grain);
  call->plan.validate(num_layers(), fused);

  const auto inputs = flatten_tensors(input);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    TORCH_CHECK(!t.defined() || t.device().is_cpu(), name_, ": input tensor #", i, " is on ",
                t.device(),
                "; RoundPipe inputs must be CPU tensors (they are split into microbatches and "
                "uploaded stage by stage). Pass it with .cpu().");
    call->input_requires_grad.push_back(training && !fused && t.defined() && t.requires_grad());
  }
  std::vector<c10::IValue> pieces;
  if (call->config.packed_input.value_or(false)) {
    TORCH_CHECK(
        input.isTuple() && static_cast<int>(input.toTupleRef().elements().size()) == call->n, name_,
        ": a packed input must be a tuple of num_microbatch = ", call->n,
        " microbatch values (the packed output of an earlier call)");
    pieces = input.toTupleRef().elements().vec();
    call->packed_input_offsets = {0};
    for (const auto& piece : pieces) {
      call->packed_input_offsets.push_back(call->packed_input_offsets.back() +
                                           flatten_tensors(piece).size());
    }
  } else if (call->config.split_input) {
    pieces = (*call->config.split_input)(input, call->n);
    TORCH_CHECK(static_cast<int>(pieces.size()) == call->n, name_, ": split_input returned ",
                pieces.size(), " microbatches, expected num_microbatch = ", call->n);
    for (bool r : call->input_requires_grad) {
      TORCH_CHECK(!r, name_,
                  ": inputs that require grad need the default split_input (their "
                  "gradients are merged back by its rules)");
    }
  } else {
    pieces = split_microbatches(input, call->n);
    const int64_t batch = batch_size_of(input);
    for (const auto& t : inputs) {
      call->input_is_split.push_back(t.defined() && t.dim() > 0 && t.size(0) == batch);
    }
  }
  // Microbatches join autograd only through PipelineFunction: detached here,
  // a backward stage never runs into the graph that produced the input.
  for (auto& piece : pieces) {
    piece = map_tensors(piece, [](const at::Tensor& t) { return t.defined() ? t.detach() : t; });
  }
  if (call->preserve_rng) {
    // Earlier calls' backward stages may still run: on simulated devices
    // their random streams borrow this generator (under the compute lock),
    // on any device a new layer instance's initialisation does.
    auto compute = pool_.at(0)->compute_lock();
    std::lock_guard<std::mutex> borrow(cpu_generator_borrow_mutex());
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    call->call_seed = gen.get<at::CPUGeneratorImpl>()->random64();
  }

  // Slots for every hand-off this call makes.
  const int L = num_layers();
  const auto& plan = call->plan;
  call->act[0] = call->new_slots();
  for (const auto& r : plan.forward) call->act[r.end] = call->new_slots();
  if (training) {
    for (size_t i = fused ? 1 : 0; i < plan.backward.size(); ++i) {
      const auto& r = plan.backward[i];
      if (call->grain == RecomputeGrain::kLayer) {
        for (int l = r.begin; l < r.end; ++l) {
          if (!call->act.count(l)) call->act[l] = call->new_slots();
        }
      } else if (!call->act.count(r.begin)) {
        call->act[r.begin] = call->new_slots();
      }
    }
    for (const auto& r : plan.backward) {
      if (r.begin > 0) call->grad[r.begin] = call->new_slots();
    }
    if (!fused) call->grad[L] = call->new_slots();
    call->input_grads.resize(call->n);
  }
  if (fused) {
    call->losses = call->new_slots();
    call->outputs = call->new_slots();
  }
  for (int m = 0; m < call->n; ++m) {
    RngState rng;
    rng.active = call->preserve_rng;
    rng.seed = microbatch_seed(call->call_seed, m);
    CallState::put(*call->act[0][m], pieces[m], {}, nullptr, rng);
  }
  return call;
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
    wait_for_jobs();
    call->rethrow_if_failed();
    throw;
  }
  return values;
}

// ---------------------------------------------------------------- autograd

namespace {

struct CallHandle : torch::CustomClassHolder {
  Engine* engine;
  std::shared_ptr<CallState> call;
};

// Connects a training forward's outputs to autograd: backward() on them runs
// the backward stages. Its outputs are CPU tensors, so the autograd engine
// calls backward on a CPU thread and never blocks a GPU's autograd thread.
struct PipelineFunction : public torch::autograd::Function<PipelineFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CallHandle> handle,
                                                at::Tensor anchor, at::TensorList inputs,
                                                std::vector<at::Tensor> outputs) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["call"] = c10::IValue::make_capsule(handle);
    ctx->saved_data["num_inputs"] = static_cast<int64_t>(inputs.size());
    torch::autograd::variable_list out;
    torch::autograd::variable_list non_differentiable;
    for (auto& t : outputs) {
      out.push_back(t);
      if (t.defined() && !at::isFloatingType(t.scalar_type())) non_differentiable.push_back(t);
    }
    ctx->mark_non_differentiable(non_differentiable);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto capsule = ctx->saved_data["call"].toCapsule();
    auto* handle = static_cast<CallHandle*>(capsule.get());
    auto& call = *handle->call;
    TORCH_CHECK(!call.backward_done, handle->engine->name(),
                ": backward ran twice through the same outputs; RoundPipe frees a call's saved "
                "activations after its backward. Run forward again.");
    const int n = call.n;
    const int L = handle->engine->num_layers();
    // Split the output gradients the way the outputs were merged.
    for (int m = 0; m < n; ++m) {
      std::vector<at::Tensor> grads;
      if (!call.packed_offsets.empty()) {  // packed: microbatch m's own tensors
        for (size_t i = call.packed_offsets[m]; i < call.packed_offsets[m + 1]; ++i) {
          const auto& g = grad_outputs[i];
          grads.push_back(g.defined() ? g.contiguous().cpu() : at::Tensor());
        }
        CallState::put(*call.grad.at(L)[m], {}, grads, nullptr, {});
        continue;
      }
      for (size_t i = 0; i < grad_outputs.size(); ++i) {
        const auto& g = grad_outputs[i];
        if (!g.defined()) {
          grads.emplace_back();
          continue;
        }
        const auto& rows = call.output_rows[i];
        if (rows[m] < 0) {
          grads.push_back((g / n).contiguous());  // a 0-dim output was averaged
        } else {
          int64_t start = 0;
          for (int k = 0; k < m; ++k) start += rows[k];
          grads.push_back(g.narrow(0, start, rows[m]).contiguous().cpu());
        }
      }
      CallState::put(*call.grad.at(L)[m], {}, grads, nullptr, {});
    }
    handle->engine->run_backward_pass(handle->call);
    call.backward_done = true;
    // Input gradients: split inputs concatenate, replicated inputs sum.
    torch::autograd::variable_list result;
    result.emplace_back();  // the handle
    result.emplace_back();  // the anchor
    const int64_t num_inputs = ctx->saved_data["num_inputs"].toInt();
    for (int64_t i = 0; i < num_inputs; ++i) {
      if (!call.packed_input_offsets.empty()) {  // each input tensor belongs to one microbatch
        const auto& offsets = call.packed_input_offsets;
        int m = 0;
        while (static_cast<size_t>(i) >= offsets[m + 1]) ++m;
        const auto& grads = call.input_grads[m];
        const size_t j = i - offsets[m];
        result.push_back(j < grads.size() ? grads[j] : at::Tensor());
        continue;
      }
      std::vector<at::Tensor> parts;
      for (int m = 0; m < n; ++m) {
        const auto& grads = call.input_grads[m];
        if (i < static_cast<int64_t>(grads.size()) && grads[i].defined()) parts.push_back(grads[i]);
      }
      if (parts.size() != static_cast<size_t>(n)) {
        result.emplace_back();
      } else if (call.input_is_split[i]) {
        result.push_back(at::cat(parts, 0));
      } else {
        at::Tensor sum = parts[0];
        for (int m = 1; m < n; ++m) sum = sum + parts[m];
        result.push_back(sum);
      }
    }
    result.emplace_back();  // the outputs argument
    return result;
  }
};

}  // namespace

void Engine::run_backward_pass(const std::shared_ptr<CallState>& call) {
  for (const auto& job : schedule(*call, CallPhase::kBackward)) dispatch(call, job);
  // Wait for this call's backward jobs and gradient downloads.
  call->wait_idle();
  if (call->aborted) call->reported = true;  // thrown here, through autograd: once
  call->rethrow_if_failed();
}

c10::IValue Engine::forward(const c10::IValue& input, const RunConfig& config) {
  check_caller_thread("forward()");
  const bool training = resolve(config).requires_grad.value();
  auto call = start_call(input, config, /*fused=*/false, training);
  for (const auto& job : schedule(*call, CallPhase::kForward)) dispatch(call, job);
  auto outs = collect(call, call->act.at(num_layers()));
  // Buffer writes are committed once the forward's jobs are done: make them
  // visible before returning.
  wait_for_jobs();
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

  // Remember how each output tensor was merged, for splitting its gradient.
  auto flat_merged = flatten_tensors(merged);
  if (packed) {
    call->packed_offsets = {0};
    for (const auto& out : outs) {
      call->packed_offsets.push_back(call->packed_offsets.back() + flatten_tensors(out).size());
    }
  } else {
    call->output_rows.assign(flat_merged.size(), {});
    for (const auto& out : outs) {
      auto flat = flatten_tensors(out);
      for (size_t i = 0; i < flat.size(); ++i) {
        call->output_rows[i].push_back(flat[i].defined() && flat[i].dim() > 0 ? flat[i].size(0)
                                                                              : -1);
      }
    }
  }
  auto handle = c10::make_intrusive<CallHandle>();
  handle->engine = this;
  handle->call = call;
  auto inputs = flatten_tensors(input);
  // The anchor requires grad so the outputs join the graph even when no
  // input does (parameter gradients go to RoundPipe's own accumulators).
  auto anchor = at::empty({0}).requires_grad_(true);
  auto connected = PipelineFunction::apply(handle, anchor, at::TensorList(inputs), flat_merged);
  unconsumed_calls_.push_back(call);  // its gradients come with its backward
  return to_output_device(replace_tensors(merged, connected));
}

ForwardBackwardResult Engine::forward_backward(const c10::IValue& input, const c10::IValue& label,
                                               const LossFn& loss_fn, bool return_outputs,
                                               const RunConfig& config) {
  check_caller_thread("forward_backward()");
  TORCH_CHECK(loss_fn, name_, ": forward_backward needs a loss_fn");
  auto call = start_call(input, config, /*fused=*/true, /*training=*/true);
  call->loss_fn = loss_fn;
  call->return_outputs = return_outputs;
  for (const auto& t : flatten_tensors(label)) {
    TORCH_CHECK(!t.defined() || t.device().is_cpu(), name_,
                ": labels must be CPU tensors; found one on ", t.device());
  }
  if (call->config.split_label) {
    call->labels = (*call->config.split_label)(label, call->n);
    TORCH_CHECK(static_cast<int>(call->labels.size()) == call->n, name_, ": split_label returned ",
                call->labels.size(), " microbatches, expected ", call->n);
  } else if (flatten_tensors(label).empty()) {
    call->labels.assign(call->n, label);
  } else {
    call->labels = split_microbatches(label, call->n);
  }
  for (const auto& job : schedule(*call, CallPhase::kFused)) dispatch(call, job);
  auto losses = collect(call, call->losses);
  ROUNDPIPE_TRACE("call %lld: losses collected", static_cast<long long>(call->id));
  // From here the call's backward stages (the last microbatch's included:
  // the losses come before it) run on in the background; the next call,
  // step() and synchronize() report their errors and take its gradients.
  unconsumed_calls_.push_back(call);
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

void Engine::settle() {
  wait_for_jobs();
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
  if (pending_publish_ >= 0) {
    publish(pending_publish_);
    version_for_new_calls_ = pending_publish_;
    pending_publish_ = -1;
  }
  auto calls = std::move(unconsumed_calls_);
  unconsumed_calls_.clear();
  for (auto& [id, g] : take_call_grads(std::move(calls))) {
    auto& grad = params_[id].home.mutable_grad();
    grad = grad.defined() ? grad.add_(g) : g;
  }
}

bool Engine::wait_for_background_work() {
  check_caller_thread("wait_for_background_work()");
  settle();
  report_failed_call();
  return pending_publish_ >= 0;
}

void Engine::restore_pending_update() {
  synchronize();
  // After synchronize() the weights are at version updates_ and nothing is
  // pending: the masters become one update ahead, published by the next
  // step() or synchronize() before anything else (ParamEntry's versions).
  ensure_masters();
  pending_publish_ = ++updates_;
}

}  // namespace roundpipe::detail

// ---------------------------------------------------------------- recompute helpers

namespace roundpipe {

void save_for_recompute(const c10::IValue& data) {
  auto* lc = detail::current_layer_call;
  // Outside RoundPipe (the same module run plainly) there is no recompute.
  if (lc == nullptr || lc->recompute) return;
  for (const auto& t : flatten_tensors(data)) {
    TORCH_CHECK(!t.defined() || !t.requires_grad(),
                "save_for_recompute(): data must not require grad (detach it)");
  }
  auto host = detail::to_device(data, c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(lc->call->recompute_mu);
  auto [it, inserted] =
      lc->call->recompute_data.emplace(std::make_pair(lc->layer, lc->microbatch), host);
  TORCH_CHECK(inserted, "save_for_recompute() called twice in layer ", lc->layer,
              " for microbatch ", lc->microbatch, "; call it once per layer per microbatch");
}

bool doing_recompute() {
  return detail::current_layer_call != nullptr && detail::current_layer_call->recompute;
}

c10::IValue get_recompute_data() {
  auto* lc = detail::current_layer_call;
  TORCH_CHECK(lc && lc->recompute,
              "get_recompute_data() is only valid during a recompute (check doing_recompute())");
  c10::IValue data;
  {
    std::lock_guard<std::mutex> lock(lc->call->recompute_mu);
    auto it = lc->call->recompute_data.find({lc->layer, lc->microbatch});
    TORCH_CHECK(it != lc->call->recompute_data.end(), "layer ", lc->layer,
                " did not call save_for_recompute() in its forward for microbatch ",
                lc->microbatch);
    data = it->second;
  }
  const auto device = lc->device;
  return detail::to_device(data, device);
}

}  // namespace roundpipe

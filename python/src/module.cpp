// roundpipe._C: the C++ engine for the Python package. The package's Python
// code (python/roundpipe) builds the user-facing API on these bindings.
// Every call that may wait on the pipeline releases the GIL; Python code the
// engine runs (layers, loss, split/merge, step functions) takes it back.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>

#include "optim/dynamic_map.h"
#include "process_group.h"
#include "py_layer.h"
#include "pytree.h"
#include "quantized.h"
#include "roundpipe/distributed.h"
#include "roundpipe/models/causal_lm.h"
#include "roundpipe/optim/adam.h"
#include "roundpipe/optim/grad_scaler.h"
#include "roundpipe/recompute.h"
#include "roundpipe/roundpipe.h"
#include "training.h"

namespace roundpipe::python {
namespace {

// ---------------------------------------------------------------- configs

std::vector<c10::IValue> to_ivalue_list(const py::object& list, const char* what, int n) {
  TORCH_CHECK(py::isinstance<py::sequence>(list) && !py::isinstance<py::str>(list), what,
              " must return a list of ", n, " microbatch values, got ",
              py::str(py::type::of(list)).cast<std::string>());
  std::vector<c10::IValue> out;
  for (auto item : list) out.push_back(to_ivalue(item));
  TORCH_CHECK(static_cast<int>(out.size()) == n, what, " returned ", out.size(),
              " microbatch values for ", n, " microbatches");
  return out;
}

SplitFn split_fn(py::object fn, const char* what) {
  PyRef ref(std::move(fn));
  return [ref, what](const c10::IValue& value, int n) {
    return with_gil([&] { return to_ivalue_list(ref.get()(to_python(value), n), what, n); });
  };
}

MergeFn merge_fn(py::object fn) {
  PyRef ref(std::move(fn));
  return [ref](const std::vector<c10::IValue>& outputs) {
    return with_gil([&] {
      py::list list;
      for (const auto& o : outputs) list.append(to_python(o));
      return to_ivalue(ref.get()(list));
    });
  };
}

ExecutePlan plan_from(const py::handle& plan) {
  auto ranges = [](const py::handle& list) {
    std::vector<LayerRange> out;
    for (auto r : list) {
      auto pair = r.cast<std::pair<int, int>>();
      out.push_back({pair.first, pair.second});
    }
    return out;
  };
  ExecutePlan out(ranges(plan.attr("_forward_ranges")()), ranges(plan.attr("_backward_ranges")()));
  out.tail_replicas = py::getattr(plan, "tail_replicas", py::int_(1)).cast<int>();
  return out;
}

// From a roundpipe.RoundPipeRunConfig already adapted by the package
// (_engine_view: split/merge callables take the engine's one value).
RunConfig run_config_from(const py::handle& cfg) {
  RunConfig rc;
  if (cfg.is_none()) return rc;
  auto field = [&](const char* name) { return cfg.attr(name); };
  if (!field("requires_grad").is_none()) rc.requires_grad = field("requires_grad").cast<bool>();
  if (!field("output_device").is_none()) {
    rc.output_device = c10::Device(py::str(field("output_device")).cast<std::string>());
  }
  if (!field("preserve_rng_state").is_none()) {
    rc.preserve_rng_state = field("preserve_rng_state").cast<bool>();
  }
  if (!field("recompute_grain").is_none()) {
    rc.recompute_grain = recompute_grain_from_string(field("recompute_grain").cast<std::string>());
  }
  if (!field("num_microbatch").is_none()) rc.num_microbatch = field("num_microbatch").cast<int>();
  if (!field("split_input").is_none())
    rc.split_input = split_fn(field("split_input"), "split_input");
  if (!field("split_label").is_none())
    rc.split_label = split_fn(field("split_label"), "split_label");
  if (!field("merge_output").is_none()) rc.merge_output = merge_fn(field("merge_output"));
  if (field("pack_output").cast<bool>()) rc.pack_output = true;
  if (field("packed_input").cast<bool>()) rc.packed_input = true;
  if (!field("execute_plan").is_none()) rc.execute_plan = plan_from(field("execute_plan"));
  const auto sums = py::getattr(cfg, "loss_sums_over_rows", py::none());
  if (!sums.is_none()) rc.loss_sums_over_rows = sums.cast<bool>();
  return rc;
}

// ---------------------------------------------------------------- engine

// Note [Engine lifetime in Python]
// Destroying an engine waits for its jobs and joins its threads, which may
// need the GIL. Python drops a RoundPipe on whatever thread holds the GIL
// (the garbage collector runs on engine threads too), so engines are
// destroyed on a thread of their own. Dropped on an ordinary thread, a
// RoundPipe first finishes its work there (GIL released), so that its last
// update is in the model when `del pipe` returns. At exit the package
// finishes every live RoundPipe while the interpreter still runs
// (finish_at_exit in __init__.py), then calls shutdown(): engines dropped
// after that, during interpreter finalization, are left to the operating
// system, since a thread that takes the GIL then is killed mid-call.
std::atomic<bool> interpreter_exiting{false};

class EngineReaper {
 public:
  static EngineReaper& get() {
    static auto* reaper = new EngineReaper();  // leaked: lives until exit
    return *reaper;
  }
  void post(RoundPipe* engine) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(engine);
    cv_.notify_all();
  }
  void wait_idle() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }

 private:
  EngineReaper() : thread_([this] { loop(); }) { thread_.detach(); }
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return !queue_.empty(); });
      RoundPipe* engine = queue_.front();
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      try {
        delete engine;
      } catch (...) {  // a destructor must not take the process down
      }
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<RoundPipe*> queue_;
  bool busy_ = false;
  std::thread thread_;
};

struct ReapEngine {
  void operator()(RoundPipe* p) const {
    if (interpreter_exiting) return;  // finished at exit; left to the OS
    if (!on_roundpipe_thread() && PyGILState_Check()) {
      try {
        py::gil_scoped_release release;
        p->synchronize();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "roundpipe: %s was dropped with an error it had not reported: %s\n",
                     p->name().c_str(), error_message(e).c_str());
      }
    }
    EngineReaper::get().post(p);
  }
};
using EnginePtr = std::unique_ptr<RoundPipe, ReapEngine>;

py::list named_list(const std::vector<std::pair<std::string, at::Tensor>>& items) {
  py::list out;
  for (const auto& [name, t] : items) out.append(py::make_tuple(name, t));
  return out;
}

py::tuple plan_tuple(const ExecutePlan& plan) {
  auto ranges = [](const std::vector<LayerRange>& rs) {
    py::list out;
    for (const auto& r : rs) out.append(py::make_tuple(r.begin, r.end));
    return out;
  };
  return py::make_tuple(ranges(plan.forward), ranges(plan.backward), plan.tail_replicas);
}

// ---------------------------------------------------------------- errors

void translate(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const StageError& e) {
    auto cls = py::module_::import("roundpipe.errors").attr("StageError");
    py::object exc =
        cls(e.what(), e.stage, e.layer, e.microbatch, e.phase, e.device, e.out_of_memory);
    if (e.cause) {
      try {
        std::rethrow_exception(e.cause);
      } catch (const PythonError& original) {
        PyException_SetCause(exc.ptr(), original.exception.get().inc_ref().ptr());
      } catch (const PythonOutOfMemoryError& original) {
        PyException_SetCause(exc.ptr(), original.exception.get().inc_ref().ptr());
      } catch (...) {
      }
    }
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (const PythonOutOfMemoryError& e) {
    py::object exc = e.exception.get();
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  } catch (const PythonError& e) {
    // Raised again as itself (e.g. from a step function).
    py::object exc = e.exception.get();
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  } catch (const c10::Error&) {
    // Torch's own message (without the C++ backtrace) and exception class.
    torch::translate_exception_to_python(std::current_exception());
  }
  // Anything else is not ours: pybind11's own translation applies.
}

}  // namespace
}  // namespace roundpipe::python

PYBIND11_MODULE(_C, m) {
  using namespace roundpipe;
  using namespace roundpipe::python;
  m.doc() = "RoundPipe's C++ engine (use the roundpipe package, not this module)";
  py::register_local_exception_translator(&translate);

  py::class_<Layer, LayerPtr>(m, "Layer")
      .def_property_readonly("type_name", &Layer::type_name)
      .def("parameter_names", &Layer::parameter_names)
      .def("__repr__", [](const Layer& l) { return "<roundpipe layer " + l.type_name() + ">"; });

  m.def(
      "python_layer",
      [](py::object module, bool takes_call_arguments) -> LayerPtr {
        return std::make_shared<PyModuleLayer>(std::move(module), takes_call_arguments);
      },
      py::arg("module"), py::arg("takes_call_arguments"));

  // The native Qwen3/Llama layers on HuggingFace's own parameter tensors.
  m.def(
      "preset_layers",
      [](const std::string& config_json, at::ScalarType dtype, py::dict hf_parameters,
         bool return_logits, int64_t loss_chunk_tokens, py::object lora, bool grouped_experts,
         int64_t expert_chunk_tokens, py::object quantize_base) {
        auto config = models::CausalLMConfig::from_json_string(config_json, "the model's config");
        models::LoraOptions adapters;
        if (!lora.is_none()) {  // {rank, alpha, dropout, use_rslora, targets,
                                // target_parameters, dtype}
          adapters.rank = lora["rank"].cast<int64_t>();
          adapters.alpha = lora["alpha"].cast<double>();
          adapters.dropout = lora["dropout"].cast<double>();
          adapters.use_rslora = lora["use_rslora"].cast<bool>();
          adapters.targets = lora["targets"].cast<std::vector<std::string>>();
          adapters.target_parameters = lora["target_parameters"].cast<std::vector<std::string>>();
          adapters.expert_rank = lora["expert_rank"].cast<std::map<std::string, int64_t>>();
          adapters.expert_alpha = lora["expert_alpha"].cast<std::map<std::string, double>>();
          adapters.dtype = lora["dtype"].cast<at::ScalarType>();
        }
        auto options = models::CausalLMOptions()
                           .set_dtype(dtype)
                           .set_return_logits(return_logits)
                           .set_loss_chunk_tokens(loss_chunk_tokens)
                           .set_grouped_experts(grouped_experts)
                           .set_expert_chunk_tokens(expert_chunk_tokens)
                           .set_init_weights(false)
                           .set_lora(adapters);
        if (!quantize_base.is_none())  // {type, double_quant, experts}: wrap.py's _quantized_base
          options
              .set_quantize_base(
                  models::quant_type_from_string(quantize_base["type"].cast<std::string>()))
              .set_double_quant(quantize_base["double_quant"].cast<bool>())
              .set_quantize_experts(quantize_base["experts"].cast<bool>());
        models::CausalLM skeleton(config, options);
        std::vector<LayerPtr> layers;
        size_t index = 0;
        for (const auto& child : *skeleton.sequential()) {
          auto inner = std::make_shared<TorchModuleLayer>(child);
          std::vector<at::Tensor> homes;
          for (const auto& name : inner->parameter_names()) {
            const auto hf = skeleton.hf_name(index, name);
            TORCH_CHECK(hf_parameters.contains(hf), "the HuggingFace model has no parameter '", hf,
                        "' that the ", config.model_type, " preset needs");
            homes.push_back(THPVariable_Unpack(hf_parameters[hf.c_str()].ptr()));
          }
          layers.push_back(with_home_parameters(inner, std::move(homes)));
          ++index;
        }
        return layers;
      },
      py::arg("config_json"), py::arg("dtype"), py::arg("hf_parameters"), py::arg("return_logits"),
      py::arg("loss_chunk_tokens"), py::arg("lora") = py::none(), py::arg("grouped_experts") = true,
      py::arg("expert_chunk_tokens") = models::CausalLMOptions().expert_chunk_tokens,
      py::arg("quantize_base") = py::none());

  py::class_<RoundPipe, EnginePtr>(m, "Engine")
      .def(py::init([](std::vector<LayerPtr> layers, std::optional<at::ScalarType> optim_dtype,
                       std::string name, std::string pin_model, std::string devices,
                       std::optional<double> model_memory_limit, bool verbose,
                       py::object process_group, std::optional<at::ScalarType> reduce_dtype,
                       bool shard_optimizer_state, std::optional<double> host_checkpoint_limit) {
             RoundPipeOptions options;
             if (!process_group.is_none()) {  // data parallel: its boxed() object
               DataParallelOptions data_parallel(process_group_from(process_group));
               data_parallel.set_shard_optimizer_state(shard_optimizer_state);
               if (reduce_dtype) data_parallel.set_reduce_dtype(*reduce_dtype);
               options.set_data_parallel(data_parallel);
             }
             options.model_memory_limit_gib = model_memory_limit;
             options.host_checkpoint_limit_gib = host_checkpoint_limit;
             options.verbose = verbose;
             options.optim_dtype = optim_dtype;
             options.pin_model = pin_mode_from_string(pin_model);
             options.name = std::move(name);
             options.devices = std::move(devices);
             // The package resolves run configs (call > model) itself and
             // hands each call its resolved one.
             py::gil_scoped_release release;
             return EnginePtr(new RoundPipe(std::move(layers), std::move(options)));
           }),
           py::arg("layers"), py::arg("optim_dtype"), py::arg("name"), py::arg("pin_model"),
           py::arg("devices"), py::arg("model_memory_limit"), py::arg("verbose"),
           py::arg("process_group") = py::none(), py::arg("reduce_dtype") = py::none(),
           py::arg("shard_optimizer_state") = false, py::arg("host_checkpoint_limit") = py::none())
      .def("forward",
           [](RoundPipe& self, py::object input, py::object run_config) {
             auto value = to_ivalue(input);
             auto config = run_config_from(run_config);
             c10::IValue out;
             {
               py::gil_scoped_release release;
               out = self.forward(value, config);
             }
             return to_python(out);
           })
      .def("forward_backward",
           [](RoundPipe& self, py::object input, py::object label, py::object loss_fn,
              bool return_outputs, py::object run_config) {
             auto value = to_ivalue(input);
             auto label_value = to_ivalue(label);
             auto config = run_config_from(run_config);
             PyRef fn(std::move(loss_fn));
             LossFn loss = [fn](const c10::IValue& out, const c10::IValue& label) {
               return with_gil([&] {
                 py::object result = fn.get()(to_python(out), to_python(label));
                 TORCH_CHECK(THPVariable_Check(result.ptr()),
                             "loss_fn must return a 0-dim tensor, got ",
                             py::str(py::type::of(result)).cast<std::string>());
                 return THPVariable_Unpack(result.ptr());
               });
             };
             ForwardBackwardResult result;
             {
               py::gil_scoped_release release;
               result = self.forward_backward(value, label_value, loss, return_outputs, config);
             }
             return py::make_tuple(result.loss, to_python(result.output));
           })
      .def("synchronize", &RoundPipe::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("wait_for_background_work", &RoundPipe::wait_for_background_work,
           py::call_guard<py::gil_scoped_release>())
      .def("restore_pending_update", &RoundPipe::restore_pending_update,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "step",
          [](RoundPipe& self, py::object step_fn, bool is_async) {
            PyRef fn(std::move(step_fn));
            py::gil_scoped_release release;
            self.step([fn] { with_gil([&] { fn.get()(); }); }, is_async);
          },
          py::arg("step_fn"), py::arg("is_async"))
      .def(
          "step_update",
          [](RoundPipe& self, py::object update, bool is_async) {
            PyRef fn(std::move(update));
            py::gil_scoped_release release;
            self.step(optim::FusedUpdate([fn](const std::vector<at::Tensor>& masters,
                                              const std::vector<at::Tensor>& grads,
                                              const std::vector<at::Tensor>& outs) {
                        with_gil([&] { fn.get()(masters, grads, outs); });
                      }),
                      is_async);
          },
          py::arg("update"), py::arg("is_async"))
      .def("optim_parameters", &RoundPipe::optim_parameters,
           py::call_guard<py::gil_scoped_release>())
      .def("optim_named_parameters",
           [](RoundPipe& self) {
             std::vector<std::pair<std::string, at::Tensor>> items;
             {
               py::gil_scoped_release release;
               items = self.optim_named_parameters();
             }
             return named_list(items);
           })
      .def("named_parameters", [](RoundPipe& self) { return named_list(self.named_parameters()); })
      .def("named_buffers", [](RoundPipe& self) { return named_list(self.named_buffers()); })
      .def_property_readonly("num_layers", &RoundPipe::num_layers)
      .def_property_readonly("name", &RoundPipe::name)
      .def_property_readonly("devices",
                             [](RoundPipe& self) {
                               std::vector<std::string> names;
                               for (int i = 0; i < self.devices().size(); ++i)
                                 names.push_back(self.devices().at(i)->name());
                               return names;
                             })
      .def("pipeline_stats",
           [](RoundPipe& self) {
             const auto s = self.pipeline_stats();
             py::dict d;
             d["optimizer_updates"] = s.optimizer_updates;
             d["optimizer_update_seconds"] = s.optimizer_update_seconds;
             d["optimizer_grad_wait_seconds"] = s.optimizer_grad_wait_seconds;
             d["optimizer_publish_seconds"] = s.optimizer_publish_seconds;
             d["weight_wait_seconds"] = s.weight_wait_seconds;
             d["call_start_wait_seconds"] = s.call_start_wait_seconds;
             d["tail_microbatches_in_row_chunks"] = s.tail_microbatches_in_row_chunks;
             d["calls_redone_for_the_loss_check"] = s.calls_redone_for_the_loss_check;
             d["calls_with_thin_checkpoints"] = s.calls_with_thin_checkpoints;
             d["last_call_planned_peak_bytes"] = s.last_call_planned_peak_bytes;
             d["upload_out_of_memory_retries"] = s.upload_out_of_memory_retries;
             d["out_of_memory_recoveries"] = s.out_of_memory_recoveries;
             return d;
           })
      .def("host_memory_stats",
           [](RoundPipe& self) {
             const auto s = self.host_memory_stats();
             py::dict d;
             d["model_state_bytes"] = s.model_state_bytes;
             d["arena_reserved_bytes"] = s.arena.reserved_bytes;
             d["arena_pinned_bytes"] = s.arena.pinned_bytes;
             d["arena_allocated_bytes"] = s.arena.allocated_bytes;
             d["arena_peak_allocated_bytes"] = s.arena.peak_allocated_bytes;
             d["arena_live_blocks"] = s.arena.live_blocks;
             d["arena_chunks"] = s.arena.chunks;
             return d;
           })
      .def("measure_weight_upload_rate", &RoundPipe::measure_weight_upload_rate,
           py::call_guard<py::gil_scoped_release>())
      .def("default_plan",
           [](RoundPipe& self, bool fused) { return plan_tuple(self.default_plan(fused)); })
      .def(
          "auto_plan",
          [](RoundPipe& self, bool fused, int num_microbatches, int min_stages,
             std::optional<double> memory_limit, int tail_rows) {
            auto estimate =
                self.auto_plan(fused, num_microbatches, min_stages, memory_limit, tail_rows);
            return py::make_tuple(plan_tuple(estimate.plan), estimate.describe());
          },
          py::arg("fused"), py::arg("num_microbatches"), py::arg("min_stages"),
          py::arg("memory_limit"), py::arg("tail_rows") = 0)
      .def_static("validate_plan", [](py::object plan, int num_layers, bool fused) {
        plan_from(plan).validate(num_layers, fused);
      });

  m.def("default_num_microbatch", &default_num_microbatch, py::arg("num_devices"),
        "the microbatch count of a call that gives none: devices + 1");
  m.def("count_loss_tokens", &models::count_loss_tokens, py::arg("labels"),
        "labels[:, 1:] != -100: the tokens the preset's loss counts");

  m.def(
      "adam_update",
      [](std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
         std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
         std::vector<std::optional<at::Tensor>> max_exp_avg_sqs, std::vector<int64_t> steps,
         double lr, double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
         bool maximize, bool decoupled_weight_decay,
         std::optional<std::vector<std::optional<at::Tensor>>> outs,
         std::optional<std::vector<std::optional<at::Tensor>>> exp_avg_absmaxes,
         std::optional<std::vector<std::optional<at::Tensor>>> exp_avg_sq_absmaxes) {
        const size_t n = params.size();
        TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                        max_exp_avg_sqs.size() == n && steps.size() == n &&
                        (!outs || outs->size() == n) &&
                        (!exp_avg_absmaxes || exp_avg_absmaxes->size() == n) &&
                        (!exp_avg_sq_absmaxes || exp_avg_sq_absmaxes->size() == n),
                    "adam_update: the lists differ in length");
        const auto entry = [](const auto& list, size_t i) {
          return list ? (*list)[i].value_or(at::Tensor()) : at::Tensor();
        };
        std::vector<optim::AdamTensors> tensors;
        for (size_t i = 0; i < n; ++i) {
          tensors.push_back({params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                             max_exp_avg_sqs[i].value_or(at::Tensor()), entry(outs, i), steps[i]});
          tensors.back().exp_avg_absmax = entry(exp_avg_absmaxes, i);
          tensors.back().exp_avg_sq_absmax = entry(exp_avg_sq_absmaxes, i);
        }
        optim::AdamConfig config;
        config.set_lr(lr)
            .set_betas(beta1, beta2)
            .set_eps(eps)
            .set_weight_decay(weight_decay)
            .set_amsgrad(amsgrad)
            .set_maximize(maximize)
            .set_decoupled_weight_decay(decoupled_weight_decay);
        py::gil_scoped_release release;
        optim::adam_update(tensors, config);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::arg("max_exp_avg_sqs"), py::arg("steps"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("amsgrad"),
      py::arg("maximize"), py::arg("decoupled_weight_decay"), py::arg("outs") = py::none(),
      py::arg("exp_avg_absmaxes") = py::none(), py::arg("exp_avg_sq_absmaxes") = py::none());
  m.def("dynamic_map", &optim::dynamic_map_tensor, py::arg("signed"),
        "the 256 codes of blockwise 8-bit optimizer state (bitsandbytes' create_dynamic_map)");

  py::class_<optim::GradScaler>(m, "GradScaler")
      .def(py::init([](double init_scale, double growth_factor, double backoff_factor,
                       int64_t growth_interval, bool enabled) {
             return std::make_unique<optim::GradScaler>(optim::GradScalerOptions()
                                                            .set_init_scale(init_scale)
                                                            .set_growth_factor(growth_factor)
                                                            .set_backoff_factor(backoff_factor)
                                                            .set_growth_interval(growth_interval)
                                                            .set_enabled(enabled));
           }),
           py::arg("init_scale"), py::arg("growth_factor"), py::arg("backoff_factor"),
           py::arg("growth_interval"), py::arg("enabled"))
      .def("scale", &optim::GradScaler::scale)
      .def("step",
           [](optim::GradScaler& self, std::vector<at::Tensor> grads, py::object update) {
             PyRef fn(std::move(update));
             py::gil_scoped_release release;
             return self.step(grads, [fn] { with_gil([&] { fn.get()(); }); });
           })
      .def("unscale", &optim::GradScaler::unscale, py::call_guard<py::gil_scoped_release>())
      .def("update", &optim::GradScaler::update, py::arg("new_scale") = py::none(),
           py::arg("is_async") = true, py::call_guard<py::gil_scoped_release>())
      .def("get_scale", &optim::GradScaler::get_scale)
      .def("is_enabled", &optim::GradScaler::is_enabled)
      .def("get_growth_factor", &optim::GradScaler::growth_factor)
      .def("get_backoff_factor", &optim::GradScaler::backoff_factor)
      .def("get_growth_interval", &optim::GradScaler::growth_interval)
      .def("set_growth_factor", &optim::GradScaler::set_growth_factor)
      .def("set_backoff_factor", &optim::GradScaler::set_backoff_factor)
      .def("set_growth_interval", &optim::GradScaler::set_growth_interval)
      .def("found_inf", &optim::GradScaler::found_inf)
      .def("state_dict", &optim::GradScaler::state_dict)
      .def("load_state_dict", &optim::GradScaler::load_state_dict);

  // See Note [Engine lifetime in Python].
  m.def(
      "shutdown",
      [] {
        EngineReaper::get().wait_idle();
        interpreter_exiting = true;
      },
      py::call_guard<py::gil_scoped_release>());

  m.def("save_for_recompute", [](py::object data) { save_for_recompute(to_ivalue(data)); });
  m.def("doing_recompute", &doing_recompute);
  m.def("loss_value_is_reported", &loss_value_is_reported);
  m.def("get_recompute_data", [] { return to_python(get_recompute_data()); });

  bind_training(m);
  bind_quantized(m);
}

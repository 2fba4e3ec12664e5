#include "roundpipe/train/trainer.h"
#include "roundpipe/train/lr_schedule.h"

#include <ATen/Parallel.h>
#include <ATen/ops/isfinite.h>
#include <roundpipe/checkpoint.h>
#include <roundpipe/distributed.h>
#include <roundpipe/models/causal_lm.h>
#include <roundpipe/train/data.h>
#include <roundpipe/train/step_data.h>
#include <roundpipe/wrap.h>
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "io/atomic_directory.h"
#include "train/hf_cache.h"
#include "train/metrics_log.h"
#include "train/option_checks.h"
#include "train/output_dir.h"
#include "train/run_settings.h"
#include "train/stop_signals.h"

namespace roundpipe::train {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

std::string eta(double seconds) {
  char text[32];
  const int64_t s = static_cast<int64_t>(seconds);
  std::snprintf(text, sizeof(text), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return text;
}

}  // namespace

bool weight_decay_applies(const std::string& name) {
  const bool bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  return !bias && name.find("norm") == std::string::npos;
}

namespace {

// This process's resident memory in bytes (Linux), else 0.
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

// ---------------------------------------------------------------- numbers

bool all_finite(const std::vector<at::Tensor>& tensors) {
  return std::all_of(tensors.begin(), tensors.end(),
                     [](const at::Tensor& t) { return at::isfinite(t).all().item<bool>(); });
}

}  // namespace

TrainSummary run_training(const TrainOptions& given) {
  validate(given);
  TrainOptions args = given;
  args.model = resolve_model_path(given.model);  // Note [Model names]
  // Data parallel under torchrun: every process trains on its share of
  // each batch; rank 0 prints and writes. Two groups: the gradients' (the
  // optimizer thread's collectives) and this loop's (losses, stops,
  // evaluations), so that the two threads never interleave collectives.
  const auto launch = LaunchEnvironment::from_environment();
  const bool leader = launch.rank == 0;
  const int processes = launch.world_size;
  c10::intrusive_ptr<c10d::ProcessGroup> control;
  std::optional<DataParallelOptions> data_parallel;
  if (launch.distributed()) {
    TORCH_CHECK(args.batch_size % processes == 0, "--batch-size ", args.batch_size,
                " must be a multiple of the ", processes,
                " processes (WORLD_SIZE): each trains on batch-size / WORLD_SIZE examples of "
                "every batch");
    const auto timeout =
        std::chrono::milliseconds(static_cast<int64_t>(args.dist_timeout_s * 1000));
    data_parallel.emplace(new_gloo_group(launch, "gradients", timeout));
    data_parallel->set_reduce_dtype(dtype_from_string(args.reduce_dtype))
        .set_shard_optimizer_state(args.shard_optimizer_state);
    control = new_gloo_group(launch, "control", timeout);
  }
  // What every process prints only once.
  auto say = [&](const char* format, auto... values) {
    if (leader) std::printf(format, values...);
  };
  // The model's configuration and the data first, then the sizes against
  // them: a run that cannot train fails before it writes or loads anything.
  const int64_t vocab_size =
      roundpipe::models::CausalLMConfig::from_json_file(
          args.model.empty() ? args.config : (fs::path(args.model) / "config.json").string())
          .vocab_size;
  // Data: a token file or JSONL, or a built-in task (with held-out
  // examples for its accuracy).
  std::shared_ptr<const Dataset> train;
  std::shared_ptr<const Dataset> eval_data;
  std::vector<Example> held_out;
  if (!args.data.empty()) {
    auto all = open_dataset(args.data, args.seq_len, vocab_size, args.model);
    if (args.eval_fraction > 0) {
      auto split = hold_out(all, args.eval_fraction, args.seed);
      train = split.train;
      eval_data = split.eval;
    } else {
      train = all;
    }
  } else {
    TORCH_CHECK(vocab_size >= roundpipe::train::ByteTokenizer::kVocab,
                "the built-in tasks use the byte-level tokenizer: the model needs vocab >= 259");
    auto make = [&](int64_t count, uint64_t seed) {
      return args.task == "addition" ? roundpipe::train::addition_task(count, args.digits, seed)
                                     : roundpipe::train::reversal_task(count, args.length, seed);
    };
    train = in_memory(make(args.train_examples, args.seed + 1));
    held_out = make(args.eval_examples, args.seed + 1000003);
  }
  if (!args.eval_data.empty()) {
    eval_data = open_dataset(args.eval_data, args.seq_len, vocab_size, args.model);
  } else if (!eval_data && !held_out.empty()) {
    eval_data = in_memory(held_out);
  }
  check_sizes(args, train->size(), processes);
  const OutputPaths paths = prepare_outputs(args, leader);
  if (args.resume && paths.has_checkpoint) {
    check_resume_settings(paths.checkpoint_extra, args, paths.checkpoint,
                          [&](const std::string& line) { say("%s\n", line.c_str()); });
  }
  StopSignals signals;
  TrainSummary summary;
  torch::manual_seed(args.seed);
  const auto dtype = dtype_from_string(args.dtype);
  const auto model_options = train::model_options(args, dtype);
  roundpipe::RunConfig run_config;
  if (args.microbatches > 0) run_config.set_num_microbatch(args.microbatches);
  // Its loss_fn returns the model's loss, scaled: it adds up over rows.
  run_config.set_loss_sums_over_rows(true);
  if (!args.recompute.empty()) {
    run_config.set_recompute_grain(roundpipe::recompute_grain_from_string(args.recompute));
  }
  auto roundpipe_options = roundpipe::RoundPipeOptions()
                               .set_devices(args.devices)
                               .set_pin_model(roundpipe::pin_mode_from_string(args.pin))
                               .set_optim_dtype(c10::kFloat)
                               .set_model_run_config(run_config);
  if (args.memory_limit_gib > 0)
    roundpipe_options.set_model_memory_limit_gib(args.memory_limit_gib);
  if (args.host_checkpoint_limit_gib > 0)
    roundpipe_options.set_host_checkpoint_limit_gib(args.host_checkpoint_limit_gib);
  if (data_parallel) roundpipe_options.set_data_parallel(*data_parallel);
  auto options = roundpipe::WrapOptions().set_model(model_options).set_roundpipe(roundpipe_options);
  const auto start_load = Clock::now();
  auto wrapped =
      args.model.empty()
          ? roundpipe::wrap_model_to_roundpipe(
                roundpipe::models::CausalLM(
                    roundpipe::models::CausalLMConfig::from_json_file(args.config), model_options),
                options)
          : roundpipe::wrap_model_to_roundpipe(args.model, options);
  auto& pipe = wrapped->pipe();
  const auto& config = wrapped->config();
  int64_t params = 0;
  for (const auto& p : pipe.parameters()) params += p.numel();
  say("roundpipe-train: %s, %lld layers, %.1fM parameters (%s), %d device(s) %s, loaded in %.1fs\n",
      config.model_type.c_str(), static_cast<long long>(config.num_hidden_layers), params / 1e6,
      args.dtype.c_str(), pipe.devices().size(), pipe.devices().at(0)->name().c_str(),
      std::chrono::duration<double>(Clock::now() - start_load).count());

  // A step adds the gradients of grad_accum batches of batch_size examples.
  const int64_t steps_per_epoch =
      roundpipe::train::steps_per_epoch(train->size(), args.batch_size, args.grad_accum);
  const int64_t total_steps = args.steps > 0    ? args.steps
                              : args.epochs > 0 ? args.epochs * steps_per_epoch
                                                : steps_per_epoch;
  say("data: %lld training examples%s, batch %lld%s, %lld steps\n",
      static_cast<long long>(train->size()),
      !eval_data ? "" : (", " + std::to_string(eval_data->size()) + " held out").c_str(),
      static_cast<long long>(args.batch_size),
      args.grad_accum > 1 ? (" x " + std::to_string(args.grad_accum) + " accumulated").c_str() : "",
      static_cast<long long>(total_steps));
  if (launch.distributed()) {
    say("data parallel: %d processes, %lld examples of each batch per process, gradients "
        "averaged in %s%s\n",
        processes, static_cast<long long>(args.batch_size / processes), args.reduce_dtype.c_str(),
        args.shard_optimizer_state ? ", optimizer state sharded" : "");
    // torchrun sets OMP_NUM_THREADS=1 unless it is set, which leaves the
    // CPU side (Adam, gradient sums, the reductions) one core a process.
    const unsigned cores = std::thread::hardware_concurrency();
    if (at::get_num_threads() == 1 && cores > 2 * static_cast<unsigned>(launch.local_world_size)) {
      say("note: this process computes on 1 CPU thread (torchrun sets OMP_NUM_THREADS=1 "
          "unless it is set); the optimizer runs on the CPU: set OMP_NUM_THREADS=%u (the "
          "cores over the processes of a node)\n",
          cores / static_cast<unsigned>(launch.local_world_size));
    }
  }

  const int microbatches = args.microbatches > 0
                               ? args.microbatches
                               : default_num_microbatch(static_cast<int>(pipe.devices().size()));
  // The mean loss over every labelled token of the held-out examples: each
  // batch's loss is its share of that mean (num_items_in_batch: all of
  // their labelled tokens), its microbatches' shares added up.
  auto evaluate = [&]() -> double {
    if (!eval_data) return -1;
    torch::NoGradGuard no_grad;
    const auto batch_at = [&](int64_t b) { return collate_range(*eval_data, b, args.batch_size); };
    // Two passes, one batch in memory at a time: the labelled tokens of
    // all, then each batch's share of their mean.
    int64_t labelled = 0;
    for (int64_t b = 0; b < eval_data->size(); b += args.batch_size)
      labelled += batch_at(b).loss_tokens;
    if (labelled == 0) return -1;
    const auto add_up = [](const std::vector<c10::IValue>& shares) {
      at::Tensor sum = shares.front().toTensor();
      for (size_t i = 1; i < shares.size(); ++i) sum = sum + shares[i].toTensor();
      return c10::IValue(sum);
    };
    // Data parallel: each process evaluates every WORLD_SIZE-th batch.
    double loss = 0;
    for (int64_t b = 0; b < eval_data->size(); b += args.batch_size) {
      if ((b / args.batch_size) % processes != launch.rank) continue;
      const auto batch = batch_at(b);
      roundpipe::models::CausalLMInput input;
      input.input_ids = batch.input_ids;
      input.labels = batch.labels;
      input.attention_mask = batch.attention_mask;
      input.num_items_in_batch = static_cast<double>(labelled);
      // (A last batch of fewer rows than microbatches runs in fewer.)
      const int rows = static_cast<int>(batch.input_ids.size(0));
      loss += pipe.forward(input.to_ivalue(),
                           roundpipe::RunConfig().set_merge_output(add_up).set_num_microbatch(
                               std::min(rows, microbatches)))
                  .toTensor()
                  .item<double>();
    }
    if (control) {
      auto sum = at::full({1}, loss, at::kDouble);
      all_reduce_sum(control, sum);
      loss = sum.item<double>();
    }
    return loss;
  };

  auto logits_of = [&](const at::Tensor& ids) {
    torch::NoGradGuard no_grad;
    auto out = pipe.forward(c10::ivalue::Tuple::create({ids, c10::IValue(), c10::IValue()}));
    return out.toTensor();
  };
  double accuracy_before = -1;
  if (!held_out.empty()) {
    accuracy_before = roundpipe::train::task_accuracy(held_out, logits_of);
    say("held-out accuracy before training: %.1f%%\n", 100 * accuracy_before);
  }

  // Two param groups, as transformers' Trainer makes them: weight decay on
  // the matrices, none on norms and biases.
  const auto adam_config = roundpipe::optim::AdamConfig()
                               .set_lr(args.lr)
                               .set_weight_decay(args.weight_decay)
                               .set_decoupled_weight_decay(true)
                               .set_optim_bits(roundpipe::train::optim_bits_of(args.optim));
  std::vector<at::Tensor> decayed, not_decayed;
  for (const auto& [name, master] : pipe.optim_named_parameters())
    (weight_decay_applies(name) ? decayed : not_decayed).push_back(master);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decayed.empty()) groups.emplace_back(decayed);
  if (!not_decayed.empty()) {
    auto options = std::make_unique<torch::optim::AdamOptions>(args.lr);
    options->weight_decay(0);
    groups.emplace_back(not_decayed, std::move(options));
  }
  roundpipe::optim::Adam adam(std::move(groups), adam_config);
  // Every step's gradient norm is measured (and clipped to max_grad_norm
  // where that is > 0) on the optimizer thread, over all of its gradients.
  roundpipe::optim::GradClipper clip(args.max_grad_norm);
  std::unique_ptr<roundpipe::optim::GradScaler> scaler;
  if (dtype == c10::kHalf) scaler = std::make_unique<roundpipe::optim::GradScaler>();
  // An error that leaves the loop waits for the queued step first: it uses
  // adam, clip and scaler (data parallel: the other processes' failures
  // arrive as such errors).
  StepsGuard steps_guard(pipe);

  roundpipe::train::LrSchedule schedule;
  schedule.kind = roundpipe::train::lr_schedule_from_string(args.lr_schedule);
  schedule.peak_lr = args.lr;
  schedule.total_steps = total_steps;
  schedule.warmup_steps = warmup_steps_of(args.warmup_ratio, args.warmup_steps, total_steps);

  int64_t first_step = 0;
  int64_t last_good_checkpoint = -1;  // the step of the newest checkpoint of finite weights
  if (args.resume && paths.has_checkpoint) {
    const auto extra = roundpipe::load_checkpoint(paths.checkpoint, pipe, &adam, scaler.get());
    first_step = step_of(extra, paths.checkpoint);
    last_good_checkpoint = first_step;
    TORCH_CHECK(first_step < total_steps, paths.checkpoint, " is at step ", first_step, " of the ",
                total_steps,
                " this run trains for: nothing is left to train; raise --steps (or --epochs)");
    say("resumed from %s at step %lld; %lld steps to go\n", paths.checkpoint.c_str(),
        static_cast<long long>(first_step), static_cast<long long>(total_steps - first_step));
  }
  // Writes the metrics lines whose steps' updates have run (set below).
  std::function<void()> flush_metrics;
  // Stops a diverged run: what went non-finite, the fix, what is kept (the
  // metrics of the steps before it are written first).
  auto diverged = [&](const std::string& what) {
    if (flush_metrics) {
      try {
        flush_metrics();
      } catch (const std::exception&) {
        // The divergence is the error to report.
      }
    }
    TORCH_CHECK(false, what, ": training diverged (lower --lr",
                dtype == c10::kFloat ? "" : ", or train in float32", "); nothing of it was saved",
                last_good_checkpoint >= 0
                    ? "; the last good checkpoint is " + paths.checkpoint + " (step " +
                          std::to_string(last_good_checkpoint) + ")"
                    : std::string());
  };
  // A training checkpoint of the state after `steps_done` steps, never of
  // non-finite weights (the last good one stays).
  const bool sharded = data_parallel && data_parallel->shard_optimizer_state;
  auto save_training_checkpoint = [&](int64_t steps_done) {
    pipe.wait_for_background_work();
    bool finite = all_finite(pipe.optim_parameters());
    if (sharded) {  // each process sees its own share of the masters
      auto flags = at::full({1}, finite ? 0.0 : 1.0, at::kDouble);
      all_reduce_sum(control, flags);
      finite = flags.item<double>() == 0;
    }
    if (!finite) diverged("the weights hold inf or NaN after step " + std::to_string(steps_done));
    // Data parallel: every process holds the same state; rank 0 writes it.
    // Sharded: every process writes its share (save_checkpoint).
    if (leader || sharded) {
      roundpipe::save_checkpoint(
          paths.checkpoint, pipe, &adam, scaler.get(),
          {{"step", std::to_string(steps_done)}, {kSettingsKey, settings_json(args)}});
    }
    last_good_checkpoint = steps_done;
    // Every update has run: the lines up to the checkpoint go to the file
    // (a resume keeps them).
    if (flush_metrics) flush_metrics();
  };
  if (signals.received()) {
    throw TrainingInterrupted("interrupted before training started", signals.received(), "");
  }

  StepData steps(train, StepDataOptions()
                            .set_batch_size(args.batch_size)
                            .set_grad_accum(args.grad_accum)
                            .set_seq_len(args.seq_len)
                            .set_packing(args.packing)
                            .set_min_rows(microbatches)
                            .set_seed(args.seed)
                            .set_process(launch.rank, processes));
  const bool tty = ::isatty(STDOUT_FILENO);
  // One JSON line per step in the output folder. A resumed run keeps the
  // lines of the steps it resumes after and rewrites the rest (the
  // interrupted run may have gone past its last checkpoint).
  MetricsLog metrics(leader ? (fs::path(paths.output) / "metrics.jsonl").string() : "", first_step);
  auto write_metrics = [&] {
    std::vector<MetricsLog::Update> updates;
    for (double norm : clip.norms()) updates.push_back({norm, std::nullopt, std::nullopt});
    metrics.write_known(updates);
  };
  flush_metrics = write_metrics;
  const auto start = Clock::now();
  auto step_start = start;
  auto window_start = start;
  int64_t tokens = 0, window_tokens = 0;
  double loss_avg = 0, last_loss = 0;
  bool first_logged = false;
  for (int64_t step = first_step; step < total_steps; ++step) {
    // Data parallel: each process batches its share of every call's
    // examples; the step's labelled tokens are counted over all shares
    // (the loss is their mean).
    auto step_data = steps.at(step);
    const auto& batches = step_data.batches;
    const int64_t step_tokens = step_data.tokens, loss_tokens = step_data.loss_tokens;
    last_loss = 0;
    for (const auto& batch : batches) {
      // (Without padding the mask is all ones: to_ivalue() leaves it out.)
      // The whole step's labelled-token count makes each microbatch's loss
      // its share of the step's token mean, which forward_backward sums and
      // the engine's gradients add up over the step's calls.
      roundpipe::models::CausalLMInput input;
      input.input_ids = batch.input_ids;
      input.labels = batch.labels;
      input.position_ids = batch.position_ids;
      input.attention_mask = batch.attention_mask;
      // Data parallel: the processes' gradients are averaged, so each
      // divides by its 1/WORLD_SIZE of the count.
      if (loss_tokens > 0) {
        input.num_items_in_batch = static_cast<double>(loss_tokens) / processes;
      }
      auto result = pipe.forward_backward(input.to_ivalue(), c10::IValue(),
                                          [&](const c10::IValue& out, const c10::IValue&) {
                                            auto loss = out.toTensor();
                                            return scaler ? scaler->scale(loss) : loss;
                                          });
      const double scale = scaler ? scaler->get_scale() : 1.0;
      last_loss += result.loss.item<double>() / scale;
    }
    // Data parallel: the step's loss is the mean of the processes' (each
    // over 1/WORLD_SIZE of the count).
    if (control) {
      auto sum = at::full({1}, last_loss, at::kDouble);
      all_reduce_sum(control, sum);
      last_loss = sum.item<double>() / processes;
    }
    if (!std::isfinite(last_loss)) {
      // Stop before the step: its update would be of non-finite gradients.
      pipe.wait_for_background_work();
      diverged("the loss is " + std::to_string(last_loss) + " at step " + std::to_string(step + 1));
    }
    // (The step takes the rate in effect now: the next one may be set before it has run.)
    adam.set_lr(schedule.at(step));
    summary.learning_rates.push_back(adam.lr());
    pipe.step(adam, /*is_async=*/!args.sync_step, scaler.get(), &clip);
    if (scaler) scaler->update();
    loss_avg = step == first_step ? last_loss : 0.9 * loss_avg + 0.1 * last_loss;
    const bool evaluating =
        args.eval_every > 0 && (step + 1) % args.eval_every == 0 && step + 1 < total_steps;
    // The step's time: from the previous step's loss to this one's, less
    // evaluations (their time counts for no step).
    const double step_seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    const double eval_loss = evaluating ? evaluate() : -1;
    step_start = Clock::now();
    {
      int64_t device_peak = 0;
      for (int d = 0; d < pipe.devices().size(); ++d)
        device_peak = std::max(device_peak, pipe.devices().at(d)->memory_stats().peak_bytes);
      nlohmann::json line{{"step", step + 1},
                          {"loss", last_loss},
                          {"lr", adam.lr()},
                          {"tokens", step_tokens},
                          {"loss_tokens", loss_tokens},
                          {"seconds", step_seconds},
                          {"tokens_per_second", step_tokens / std::max(step_seconds, 1e-9)},
                          {"device_peak_bytes", device_peak},
                          {"host_resident_bytes", resident_bytes()}};
      metrics.add_step(line.dump());
      if (eval_loss >= 0) metrics.add_eval(step + 1, eval_loss);
      write_metrics();
    }
    tokens += step_tokens;
    window_tokens += step_tokens;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const bool last = step + 1 == total_steps;
    if ((step + 1) % args.log_every == 0 || last) {
      if (!first_logged) summary.first_loss = loss_avg;
      first_logged = true;
      // Throughput of the steps since the last line (the first includes warm-up).
      const auto now = Clock::now();
      const double rate =
          window_tokens / std::max(std::chrono::duration<double>(now - window_start).count(), 1e-9);
      window_start = now;
      window_tokens = 0;
      const double left = elapsed / (step + 1 - first_step) * (total_steps - step - 1);
      // The newest norm known (an async step's arrives during the next).
      const auto norms = clip.norms();
      char norm_text[48] = "";
      if (!norms.empty())
        std::snprintf(norm_text, sizeof(norm_text), "  grad norm %.3g (step %lld)", norms.back(),
                      static_cast<long long>(first_step + static_cast<int64_t>(norms.size())));
      say("%sstep %lld/%lld  loss %.4f%s  %.0f tokens/s  elapsed %s  ETA %s%s", tty ? "\r" : "",
          static_cast<long long>(step + 1), static_cast<long long>(total_steps), loss_avg,
          norm_text, rate, eta(elapsed).c_str(), eta(left).c_str(), tty && !last ? "   " : "\n");
      std::fflush(stdout);
    }
    if (args.after_step) args.after_step(step + 1);
    // Data parallel: a process asked to stop stops them all after this step.
    bool stop = signals.received() != 0;
    if (control) {
      auto flags = at::full({1}, stop ? 1.0 : 0.0, at::kDouble);
      all_reduce_sum(control, flags);
      stop = flags.item<double>() > 0;
    }
    if (stop && !last) {
      save_training_checkpoint(step + 1);
      const char* name = signals.received() == SIGINT    ? "SIGINT"
                         : signals.received() == SIGTERM ? "SIGTERM"
                                                         : "another process's signal";
      throw TrainingInterrupted(
          std::string("interrupted by ") + name + " after step " + std::to_string(step + 1) +
              " of " + std::to_string(total_steps) +
              ": saved a training checkpoint "
              "to " +
              paths.checkpoint + "; continue with --resume",
          signals.received() != 0 ? signals.received() : SIGTERM, paths.checkpoint);
    }
    if (stop && last) {
      say("the signal came after the last step: finishing the run (saving the model) instead "
          "of a training checkpoint\n");
    }
    if (args.checkpoint_every > 0 && (step + 1) % args.checkpoint_every == 0 && !last) {
      save_training_checkpoint(step + 1);
    }
  }
  pipe.synchronize();
  write_metrics();
  summary.grad_norms = clip.norms();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  say("\nsummary: %lld steps, %lld tokens in %.1fs = %.0f tokens/s, final loss %.4f\n",
      static_cast<long long>(total_steps - first_step), static_cast<long long>(tokens), seconds,
      tokens / std::max(seconds, 1e-9), loss_avg);
  // What a user sizing a card reads: each device's peak against its budget.
  for (int d = 0; d < pipe.devices().size(); ++d) {
    const auto& device = pipe.devices().at(d);
    const auto memory = device->memory_stats();
    if (memory.budget_bytes <= 0) continue;
    say("device memory: %s peak %.2f GiB of %.2f GiB\n", device->name().c_str(),
        memory.peak_bytes / 1073741824.0, memory.budget_bytes / 1073741824.0);
  }
  if (!all_finite(pipe.parameters())) diverged("the trained weights hold inf or NaN");
  summary.eval_loss = evaluate();
  if (summary.eval_loss >= 0) {
    say("held-out loss %.4f, perplexity %.2f (%lld examples)\n", summary.eval_loss,
        std::exp(summary.eval_loss), static_cast<long long>(eval_data->size()));
    metrics.add_eval(total_steps, summary.eval_loss);
    write_metrics();
  }
  if (!held_out.empty()) {
    summary.accuracy_after = roundpipe::train::task_accuracy(held_out, logits_of);
    say("held-out accuracy: %.1f%% before, %.1f%% after training\n", 100 * accuracy_before,
        100 * summary.accuracy_after);
  }
  summary.accuracy_before = accuracy_before;
  summary.steps = total_steps - first_step;
  summary.tokens = tokens;
  summary.seconds = seconds;
  summary.tokens_per_second = tokens / std::max(seconds, 1e-9);
  summary.final_loss = loss_avg;
  if (!leader) return summary;  // rank 0 saves the model every process holds
  try {
    if (args.lora_rank > 0 && !args.merge) {
      pipe.synchronize();
      wrapped->model().save_adapter(paths.output, args.model);
    } else {
      if (args.lora_rank > 0) {
        pipe.synchronize();
        wrapped->model().merge_lora();
      }
      wrapped->save_pretrained(paths.output);
    }
  } catch (const std::exception& e) {
    // The trained model must not be lost: keep it as a training checkpoint.
    const std::string why = error_message(e);
    TORCH_CHECK(!sharded, "cannot save the trained model to ", paths.output, " (", why,
                "); with sharded optimizer state only the periodic checkpoints in ",
                paths.checkpoint, " are kept (rank 0 cannot write the others' shares alone)");
    try {
      roundpipe::save_checkpoint(
          paths.checkpoint, pipe, &adam, scaler.get(),
          {{"step", std::to_string(total_steps)}, {kSettingsKey, settings_json(args)}});
    } catch (const std::exception& second) {
      TORCH_CHECK(false, "cannot save the trained model to ", paths.output, " (", why,
                  ") nor a training checkpoint to ", paths.checkpoint, " (", error_message(second),
                  ")");
    }
    TORCH_CHECK(false, "cannot save the trained model to ", paths.output, " (", why,
                "); it is kept as a training checkpoint in ", paths.checkpoint);
  }
  copy_tokenizer_files(args.model, paths.output);
  if (args.lora_rank > 0 && !args.merge) {
    std::printf("saved the LoRA adapter (peft's format) to %s\n", paths.output.c_str());
  } else {
    std::printf("saved a HuggingFace checkpoint to %s\n", paths.output.c_str());
  }
  return summary;
}

}  // namespace roundpipe::train

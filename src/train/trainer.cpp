#include "roundpipe/train/trainer.h"

#include <roundpipe/atomic_directory.h>
#include <roundpipe/checkpoint.h>
#include <roundpipe/train/data.h>
#include <roundpipe/wrap.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

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

TrainSummary run_training(const TrainOptions& args) {
  TrainSummary summary;
  torch::manual_seed(args.seed);
  const auto dtype = dtype_from_string(args.dtype);
  auto model_options =
      roundpipe::models::CausalLMOptions().set_dtype(dtype).set_loss_chunk_tokens(args.loss_chunk);
  roundpipe::RunConfig run_config;
  if (args.microbatches > 0) run_config.set_num_microbatch(args.microbatches);
  run_config.set_recompute_grain(args.recompute == "layer" ? roundpipe::RecomputeGrain::kLayer
                                                           : roundpipe::RecomputeGrain::kStage);
  TORCH_CHECK(args.recompute == "layer" || args.recompute == "stage",
              "--recompute must be stage or layer");
  auto options = roundpipe::WrapOptions()
                     .set_model(model_options)
                     .set_roundpipe(roundpipe::RoundPipeOptions()
                                        .set_devices(args.devices)
                                        .set_pin_model(roundpipe::pin_mode_from_string(args.pin))
                                        .set_optim_dtype(c10::kFloat)
                                        .set_model_run_config(run_config));
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
  std::printf(
      "roundpipe-train: %s, %lld layers, %.1fM parameters (%s), %d device(s) %s, loaded in %.1fs\n",
      config.model_type.c_str(), static_cast<long long>(config.num_hidden_layers), params / 1e6,
      args.dtype.c_str(), pipe.devices().size(), pipe.devices().at(0)->name().c_str(),
      std::chrono::duration<double>(Clock::now() - start_load).count());

  // Data.
  std::vector<roundpipe::train::Example> train, held_out;
  if (!args.data.empty()) {
    train = roundpipe::train::load_jsonl(args.data, args.seq_len, config.vocab_size);
  } else {
    TORCH_CHECK(args.task == "addition" || args.task == "reverse",
                "--task must be reverse or addition (or give --data)");
    TORCH_CHECK(config.vocab_size >= roundpipe::train::ByteTokenizer::kVocab,
                "the built-in tasks use the byte-level tokenizer: the model needs vocab >= 259");
    auto make = [&](int64_t count, uint64_t seed) {
      return args.task == "addition" ? roundpipe::train::addition_task(count, args.digits, seed)
                                     : roundpipe::train::reversal_task(count, args.length, seed);
    };
    train = make(args.train_examples, args.seed + 1);
    held_out = make(args.eval_examples, args.seed + 1000003);
  }
  const int64_t steps_per_epoch =
      std::max<int64_t>(1, static_cast<int64_t>(train.size()) / args.batch_size);
  const int64_t total_steps = args.steps > 0    ? args.steps
                              : args.epochs > 0 ? args.epochs * steps_per_epoch
                                                : steps_per_epoch;
  std::printf(
      "data: %zu training examples%s, batch %lld, %lld steps\n", train.size(),
      held_out.empty() ? "" : (", " + std::to_string(held_out.size()) + " held out").c_str(),
      static_cast<long long>(args.batch_size), static_cast<long long>(total_steps));

  auto logits_of = [&](const at::Tensor& ids) {
    torch::NoGradGuard no_grad;
    auto out = pipe.forward(c10::ivalue::Tuple::create({ids, c10::IValue(), c10::IValue()}));
    return out.toTensor();
  };
  double accuracy_before = -1;
  if (!held_out.empty()) {
    accuracy_before = roundpipe::train::task_accuracy(held_out, logits_of);
    std::printf("held-out accuracy before training: %.1f%%\n", 100 * accuracy_before);
  }

  roundpipe::optim::Adam adam(pipe.optim_parameters(), roundpipe::optim::AdamConfig()
                                                           .set_lr(args.lr)
                                                           .set_weight_decay(args.weight_decay)
                                                           .set_decoupled_weight_decay(true));
  std::unique_ptr<roundpipe::optim::GradScaler> scaler;
  if (dtype == c10::kHalf) scaler = std::make_unique<roundpipe::optim::GradScaler>();

  int64_t first_step = 0;
  const std::string ckpt =
      args.checkpoint_dir.empty() ? args.output + ".ckpt" : args.checkpoint_dir;
  if (args.resume && fs::exists(roundpipe::readable_directory(ckpt))) {
    const auto extra = roundpipe::load_checkpoint(ckpt, pipe, &adam, scaler.get());
    TORCH_CHECK(extra.count("step"), ckpt, " was not written by roundpipe-train (no step)");
    first_step = std::stoll(extra.at("step"));
    std::printf("resumed from %s at step %lld\n", ckpt.c_str(), static_cast<long long>(first_step));
  }

  std::vector<int64_t> order(train.size());
  std::iota(order.begin(), order.end(), 0);
  const bool tty = ::isatty(STDOUT_FILENO);
  const auto start = Clock::now();
  auto window_start = start;
  int64_t tokens = 0, window_tokens = 0;
  double loss_avg = 0, last_loss = 0;
  bool first_logged = false;
  for (int64_t step = first_step; step < total_steps; ++step) {
    const int64_t epoch = step / steps_per_epoch;
    if (step % steps_per_epoch == 0 || step == first_step) {
      order.assign(train.size(), 0);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937_64(args.seed + epoch));
    }
    auto batch = roundpipe::train::collate(train, order, (step % steps_per_epoch) * args.batch_size,
                                           args.batch_size);
    // Without padding the mask is all ones: leave it out, so attention
    // stays causal-only (flash attention on GPUs).
    const bool padded = batch.tokens < batch.input_ids.numel();
    auto input = c10::ivalue::Tuple::create(
        {batch.input_ids, padded ? c10::IValue(batch.attention_mask) : c10::IValue(),
         batch.labels});
    auto result = pipe.forward_backward(input, c10::IValue(),
                                        [&](const c10::IValue& out, const c10::IValue&) {
                                          auto loss = out.toTensor();
                                          return scaler ? scaler->scale(loss) : loss;
                                        });
    pipe.step(adam, /*is_async=*/!args.sync_step, scaler.get());
    if (scaler) scaler->update();
    const int n = args.microbatches > 0 ? args.microbatches : pipe.devices().size() + 1;
    last_loss = result.loss.item<double>() / n / (scaler ? scaler->get_scale() : 1.0);
    loss_avg = step == first_step ? last_loss : 0.9 * loss_avg + 0.1 * last_loss;
    tokens += batch.tokens;
    window_tokens += batch.tokens;
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
      std::printf("%sstep %lld/%lld  loss %.4f  %.0f tokens/s  elapsed %s  ETA %s%s",
                  tty ? "\r" : "", static_cast<long long>(step + 1),
                  static_cast<long long>(total_steps), loss_avg, rate, eta(elapsed).c_str(),
                  eta(left).c_str(), tty && !last ? "   " : "\n");
      std::fflush(stdout);
    }
    if (args.checkpoint_every > 0 && (step + 1) % args.checkpoint_every == 0 && !last) {
      roundpipe::save_checkpoint(ckpt, pipe, &adam, scaler.get(),
                                 {{"step", std::to_string(step + 1)}});
    }
  }
  pipe.synchronize();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("\nsummary: %lld steps, %lld tokens in %.1fs = %.0f tokens/s, final loss %.4f\n",
              static_cast<long long>(total_steps - first_step), static_cast<long long>(tokens),
              seconds, tokens / std::max(seconds, 1e-9), loss_avg);
  if (!held_out.empty()) {
    summary.accuracy_after = roundpipe::train::task_accuracy(held_out, logits_of);
    std::printf("held-out accuracy: %.1f%% before, %.1f%% after training\n", 100 * accuracy_before,
                100 * summary.accuracy_after);
  }
  summary.accuracy_before = accuracy_before;
  summary.steps = total_steps - first_step;
  summary.tokens = tokens;
  summary.seconds = seconds;
  summary.tokens_per_second = tokens / std::max(seconds, 1e-9);
  summary.final_loss = loss_avg;
  wrapped->save_pretrained(args.output);
  std::printf("saved a HuggingFace checkpoint to %s\n", args.output.c_str());
  return summary;
}

}  // namespace roundpipe::train

// roundpipe-train's option checks: see option_checks.h.
#include "train/option_checks.h"

#include <c10/util/Exception.h>
#include <roundpipe/options.h>
#include <roundpipe/train/lr_schedule.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace roundpipe::train {
namespace {

void check(bool ok, const char* option, const std::string& accepted, const std::string& got) {
  TORCH_CHECK(ok, option, " must be ", accepted, ", got ", got);
}

}  // namespace

int optim_bits_of(const std::string& optim) {
  if (optim == "adamw") return 32;
  if (optim == "adamw8bit" || optim == "adamw_8bit" || optim == "adamw_bnb_8bit") return 8;
  TORCH_CHECK(false,
              "--optim: expected adamw (float32 moments) or adamw8bit (blockwise 8-bit "
              "moments, as bitsandbytes' AdamW8bit), got '",
              optim, "'");
}

// The sizes against the data (before the model loads): a step needs
// batch-size x grad-accum examples, and a microbatch at least one row of
// each process's share of a batch.
void check_sizes(const TrainOptions& a, int64_t train_examples, int processes) {
  const int64_t step_examples = a.batch_size * a.grad_accum;
  TORCH_CHECK(a.batch_size <= train_examples && step_examples <= train_examples, "--batch-size ",
              a.batch_size,
              a.grad_accum > 1 ? " x --grad-accum " + std::to_string(a.grad_accum) : std::string(),
              " needs ", step_examples, " examples a step, more than the ", train_examples,
              " training examples there are: lower it (or give more data)");
  const int64_t rows = a.batch_size / std::max(processes, 1);
  TORCH_CHECK(a.microbatches <= rows, "--microbatches ", a.microbatches, " is more than the ", rows,
              " examples of a batch", processes > 1 ? " per process" : "",
              ": a microbatch needs at least one; give --microbatches ", rows,
              " or fewer (or a larger --batch-size)");
}

void validate(const TrainOptions& a) {
  auto text = [](auto v) { return std::to_string(v); };
  check(a.batch_size >= 1, "--batch-size", "at least 1", text(a.batch_size));
  check(a.seq_len >= 2, "--seq-len", "at least 2 (a token and the next)", text(a.seq_len));
  check(a.steps >= 0, "--steps", ">= 0 (0: one epoch, or --epochs)", text(a.steps));
  check(a.epochs >= 0, "--epochs", ">= 0", text(a.epochs));
  check(a.checkpoint_every >= 0, "--checkpoint-every", ">= 0 (0: no periodic checkpoints)",
        text(a.checkpoint_every));
  check(a.log_every >= 1, "--log-every", "at least 1", text(a.log_every));
  check(a.grad_accum >= 1, "--grad-accum", "at least 1 (batches per optimizer step)",
        text(a.grad_accum));
  check(a.eval_every >= 0, "--eval-every", ">= 0 (0: at the end only)", text(a.eval_every));
  check(a.reduce_dtype == "float32" || a.reduce_dtype == "bfloat16", "--reduce-dtype",
        "float32 or bfloat16", a.reduce_dtype);
  check(a.dist_timeout_s > 0, "--dist-timeout", "> 0 seconds", text(a.dist_timeout_s));
  check(!a.shard_optimizer_state || a.dtype != "float16", "--shard-optimizer-state",
        "bfloat16 or float32 training (float16's loss scaling would need every process's "
        "inf/NaN check)",
        "set with --dtype float16");
  check(a.microbatches >= 0, "--microbatches", ">= 0 (0: devices + 1)", text(a.microbatches));
  check(a.train_examples >= 1, "--train-examples", "at least 1", text(a.train_examples));
  check(a.eval_examples >= 0, "--eval-examples", ">= 0", text(a.eval_examples));
  check(a.loss_chunk >= 1, "--loss-chunk", "at least 1", text(a.loss_chunk));
  check(a.lora_rank >= 0, "--lora-rank", ">= 0 (0: no LoRA)", text(a.lora_rank));
  check(std::isfinite(a.lora_alpha) && a.lora_alpha > 0, "--lora-alpha", "a positive number",
        text(a.lora_alpha));
  check(a.lora_dropout >= 0 && a.lora_dropout < 1, "--lora-dropout", "in [0, 1)",
        text(a.lora_dropout));
  check(!a.merge || a.lora_rank > 0, "--merge", "only with --lora-rank", "set without LoRA");
  check(a.quantize_base.empty() || a.quantize_base == "nf4" || a.quantize_base == "fp4" ||
            a.quantize_base == "int8" || a.quantize_base == "fp8",
        "--quantize-base", "nf4, fp4, int8 or fp8", a.quantize_base);
  check(a.quantize_base.empty() || a.lora_rank > 0, "--quantize-base",
        "used with --lora-rank (the quantized base weights are frozen: only adapters train)",
        "set without LoRA");
  check(a.quantize_base.empty() || !a.merge, "--quantize-base",
        "without --merge (merging would quantize the adapters away; the adapter is written in "
        "peft's layout)",
        "set with --merge");
  check(a.digits >= 1 && a.digits <= 9, "--digits", "between 1 and 9", text(a.digits));
  check(a.length >= 1, "--length", "at least 1", text(a.length));
  check(std::isfinite(a.lr) && a.lr > 0, "--lr", "a positive number", text(a.lr));
  lr_schedule_from_string(a.lr_schedule);  // (names the choices)
  check(a.warmup_steps >= 0, "--warmup-steps", ">= 0", text(a.warmup_steps));
  check(std::isfinite(a.warmup_ratio) && a.warmup_ratio >= 0 && a.warmup_ratio < 1,
        "--warmup-ratio", "in [0, 1)", text(a.warmup_ratio));
  check(a.warmup_steps == 0 || a.warmup_ratio == 0, "--warmup-steps",
        "0 when --warmup-ratio is given (one or the other)", text(a.warmup_steps));
  optim_bits_of(a.optim);  // (names the choices)
  check(std::isfinite(a.weight_decay) && a.weight_decay >= 0, "--weight-decay", ">= 0",
        text(a.weight_decay));
  check(std::isfinite(a.max_grad_norm) && a.max_grad_norm >= 0, "--max-grad-norm",
        ">= 0 (0: no clipping)", text(a.max_grad_norm));
  check(std::isfinite(a.eval_fraction) && a.eval_fraction >= 0 && a.eval_fraction < 1,
        "--eval-fraction", "in [0, 1)", text(a.eval_fraction));
  check(a.eval_fraction == 0 || a.eval_data.empty(), "--eval-fraction",
        "0 when --eval-data is given (one or the other)", text(a.eval_fraction));
  check(a.eval_fraction == 0 || !a.data.empty(), "--eval-fraction",
        "used with --data (the built-in tasks hold out their own examples)", text(a.eval_fraction));
  check(a.recompute.empty() || a.recompute == "stage" || a.recompute == "layer" ||
            a.recompute == "layer_from_stage",
        "--recompute", "stage, layer or layer_from_stage", a.recompute);
  check(std::isfinite(a.memory_limit_gib) && a.memory_limit_gib >= 0, "--memory-limit",
        "a size in GiB (0: what the device grants)", text(a.memory_limit_gib));
  check(std::isfinite(a.host_checkpoint_limit_gib) && a.host_checkpoint_limit_gib >= 0,
        "--host-checkpoint-limit", "a size in GiB (0: three quarters of what the host has)",
        text(a.host_checkpoint_limit_gib));
  dtype_from_string(a.dtype);
  pin_mode_from_string(a.pin);
  if (a.data.empty()) {
    check(a.task == "addition" || a.task == "reverse", "--task",
          "reverse or addition (or give --data)", a.task);
  }
}

models::CausalLMOptions model_options(const TrainOptions& args, c10::ScalarType dtype) {
  auto model_options =
      models::CausalLMOptions().set_dtype(dtype).set_loss_chunk_tokens(args.loss_chunk);
  if (args.lora_rank > 0) {
    auto split = [](const std::string& text) {
      std::vector<std::string> names;
      std::stringstream list(text);
      for (std::string t; std::getline(list, t, ',');)
        if (!t.empty()) names.push_back(t);
      return names;
    };
    const auto targets = split(args.lora_targets);
    // Adapters in float32 on a half-precision base, as peft keeps them.
    model_options.set_lora(models::LoraOptions()
                               .set_rank(args.lora_rank)
                               .set_alpha(args.lora_alpha)
                               .set_dropout(args.lora_dropout)
                               .set_targets(targets)
                               .set_target_parameters(split(args.lora_target_parameters)));
    model_options.lora.dtype = c10::kFloat;
  }
  if (!args.quantize_base.empty())
    model_options.set_quantize_base(models::quant_type_from_string(args.quantize_base));
  return model_options;
}

}  // namespace roundpipe::train

// The training loop behind roundpipe-train, as a library function so that
// tests run exactly what the command runs.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace roundpipe::train {

struct TrainOptions {
  std::string model, config = "configs/qwen3-tiny/config.json", data, task = "addition";
  // Held-out data (as `data`) whose loss and perplexity are measured every
  // eval_every steps (0: at the end only) and at the end, with the weights
  // the next step trains on; the built-in tasks use their held-out examples.
  std::string eval_data;
  int64_t eval_every = 0;
  // Without eval_data: this fraction of `data`'s examples is held out (the
  // last ones after a shuffle by seed) and evaluated as eval_data would be.
  double eval_fraction = 0;
  // recompute: "stage", "layer", "layer_from_stage" or "" (the automatic
  // plan chooses).
  std::string output = "roundpipe-out", devices, dtype = "float32", pin = "alloc", recompute;
  double memory_limit_gib = 0;  // the plan's device memory limit; 0: what the device grants
  // Host memory for a call's checkpoints (RoundPipeOptions::
  // host_checkpoint_limit_gib); 0: three quarters of what the host has.
  double host_checkpoint_limit_gib = 0;
  std::string checkpoint_dir;
  int64_t batch_size = 64, seq_len = 512, steps = 0, epochs = 0, checkpoint_every = 0,
          log_every = 10;
  int64_t train_examples = 20000, eval_examples = 500, loss_chunk = 2048;
  int microbatches = 0, digits = 2, length = 4;
  // Batches of batch_size whose gradients one optimizer step adds: the step
  // is that of one batch of grad_accum x batch_size examples.
  int64_t grad_accum = 1;
  double lr = 3e-4, weight_decay = 0.01;
  // "adamw" (float32 moments) or "adamw8bit" (bitsandbytes' blockwise 8-bit
  // moments, a quarter of the memory; also spelled adamw_8bit, adamw_bnb_8bit).
  std::string optim = "adamw";
  // Gradients are clipped to this global L2 norm before each update
  // (clip_grad_norm_, transformers' default 1.0); 0 only measures it. The
  // norm of every step is reported either way.
  double max_grad_norm = 1.0;
  // The learning rate per update (LrSchedule): "constant", "linear" or
  // "cosine", after a linear warmup of warmup_steps updates, or of
  // warmup_ratio of all updates when that is > 0.
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0;
  double warmup_ratio = 0;
  bool resume = false, sync_step = false;
  // Settings --resume may find changed (comma-separated: "steps,lr"); any
  // other change is refused (Note [Resume settings]).
  std::string allow_resume_change;
  // LoRA (lora_rank > 0): adapters on lora_targets ("all-linear" or
  // projection names, comma-separated) and on lora_target_parameters (the
  // experts' stacked weights, peft's target_parameters: e.g.
  // "mlp.experts.gate_up_proj,mlp.experts.down_proj"); the output is the
  // adapter in peft's layout, or with merge the merged full weights.
  int64_t lora_rank = 0;
  double lora_alpha = 16, lora_dropout = 0;
  std::string lora_targets = "all-linear";
  std::string lora_target_parameters;
  bool merge = false;
  // QLoRA: the base's projections and experts quantized ("nf4" or "fp4": 4
  // bits; "int8" or "fp8": 8 bits; empty: full precision) as the checkpoint
  // loads (CausalLMOptions::quantize_base). Needs lora_rank > 0; not with
  // merge.
  std::string quantize_base;
  // Pack a step's examples into rows (train::pack) instead of one padded
  // example a row (train::collate); either way the loss is the mean over
  // the step's labelled tokens.
  bool packing = true;
  // Replace a model already in `output` and a training checkpoint of an
  // earlier run (without it, either is an error before training starts).
  bool overwrite = false;
  uint64_t seed = 0;
  // Data parallel under torchrun (WORLD_SIZE > 1 in the environment): the
  // dtype of the gradients on the network ("float32" or "bfloat16"), and
  // how long a collective waits for the other processes before failing.
  std::string reduce_dtype = "float32";
  double dist_timeout_s = 1800;
  // Each process keeps the masters and Adam moments of 1/WORLD_SIZE of the
  // parameters (DataParallelOptions::shard_optimizer_state); checkpoints
  // are written a share per process and resume with any process count.
  bool shard_optimizer_state = false;
  // Called after each finished step with the number of steps done (tests
  // use it to interrupt a run at a chosen step).
  std::function<void(int64_t steps_done)> after_step;
};

// Checks every option; throws naming the option and what it accepts.
void validate(const TrainOptions& options);

// Whether --weight-decay applies to the parameter `name` (as transformers'
// Trainer: not to norms' weights nor to biases).
bool weight_decay_applies(const std::string& name);

struct TrainSummary {
  int64_t steps = 0;
  int64_t tokens = 0;
  double seconds = 0;
  double tokens_per_second = 0;
  double first_loss = 0;                             // smoothed loss after the first logged step
  double final_loss = 0;                             // smoothed loss at the end
  double accuracy_before = -1, accuracy_after = -1;  // built-in tasks only
  std::vector<double> learning_rates;                // of each update this run made
  std::vector<double> grad_norms;  // each update's global gradient norm, before clipping
  double eval_loss = -1;  // at the end: mean over the held-out labelled tokens (-1: no data)
};

// SIGINT or SIGTERM arrived: the step in flight was finished and a training
// checkpoint written (when `checkpoint` is not empty) before this is thrown.
class TrainingInterrupted : public std::runtime_error {
 public:
  TrainingInterrupted(const std::string& message, int signal, std::string checkpoint)
      : std::runtime_error(message), signal(signal), checkpoint(std::move(checkpoint)) {}
  int signal;
  std::string checkpoint;
};

// Loads or builds the model, trains, prints progress to stdout, and saves a
// HuggingFace checkpoint to options.output. Under torchrun (WORLD_SIZE > 1)
// every process trains on its share of each batch (batch_size / WORLD_SIZE
// examples) with the gradients averaged over the processes, and rank 0
// alone prints and writes (metrics, checkpoints, the model); a resume reads
// the checkpoint on every process (a directory all of them see). Before training it checks the
// options, the data and the output paths, and removes temporaries that
// killed runs left there. A non-finite loss stops training with an error
// (the last good training checkpoint stays); SIGINT/SIGTERM finish the
// current step, write a training checkpoint and throw TrainingInterrupted
// (a second signal ends the process at once). Throws on errors.
TrainSummary run_training(const TrainOptions& options);

}  // namespace roundpipe::train

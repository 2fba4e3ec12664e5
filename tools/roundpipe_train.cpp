// roundpipe-train: fine-tune a HuggingFace-format Qwen3/Llama checkpoint
// (or a model built from a config.json) through RoundPipe, on a token file
// of roundpipe.prepare, a JSONL dataset or a built-in task, with the asynchronous fused Adam,
// checkpoints and resume; saves a HuggingFace checkpoint at the end. Under
// torchrun (--no-python) its processes train data parallel.
#include <roundpipe/errors.h>
#include <roundpipe/train/trainer.h>

#include <CLI/CLI.hpp>
#include <cstdio>

int main(int argc, char** argv) {
  CLI::App app{"roundpipe-train: fine-tune a Qwen3/Llama checkpoint through RoundPipe"};
  roundpipe::train::TrainOptions a;
  app.add_option("--model", a.model,
                 "HuggingFace checkpoint directory (config.json + safetensors)");
  app.add_option("--config", a.config,
                 "config.json for a randomly initialised model (without --model)");
  app.add_option("--data", a.data,
                 "token file of python -m roundpipe.prepare (mapped from disk; its tokenizer must "
                 "be --model's), or JSONL: input_ids[/labels], text, or prompt/completion");
  app.add_option("--task", a.task, "built-in task when no --data: reverse or addition");
  app.add_option("--length", a.length, "letters per word of the reverse task");
  app.add_option("--digits", a.digits, "digits per operand of the addition task");
  app.add_option("--train-examples", a.train_examples, "examples generated for the task");
  app.add_option("--eval-examples", a.eval_examples, "held-out examples for the task");
  app.add_option("--output", a.output, "where to save the trained HuggingFace checkpoint");
  app.add_option("--batch-size", a.batch_size, "examples per step");
  app.add_option("--seq-len", a.seq_len, "maximum tokens per example and per packed row");
  bool no_packing = false;
  app.add_flag("--no-packing", no_packing,
               "one example per row, right padded with an attention mask (default: short "
               "examples packed into rows, positions restarting per example)");
  app.add_option("--microbatches", a.microbatches, "microbatches per step (default: devices + 1)");
  app.add_option("--lr", a.lr, "learning rate (AdamW)");
  app.add_option("--weight-decay", a.weight_decay, "decoupled weight decay");
  app.add_option("--optim", a.optim,
                 "adamw (float32 moments, 8 bytes a parameter) or adamw8bit (bitsandbytes' "
                 "blockwise 8-bit moments, 2 bytes a parameter)");
  app.add_option("--eval-data", a.eval_data,
                 "held-out data (as --data) whose loss and perplexity are measured at the end "
                 "and every --eval-every steps");
  app.add_option("--eval-fraction", a.eval_fraction,
                 "hold out this fraction of --data for evaluation (instead of --eval-data)");
  app.add_option("--max-grad-norm", a.max_grad_norm,
                 "clip gradients to this global L2 norm before each update (0: no clipping; the "
                 "norm is reported either way)");
  app.add_option("--eval-every", a.eval_every, "steps between evaluations (0: at the end only)");
  app.add_option("--grad-accum", a.grad_accum,
                 "batches whose gradients each optimizer step adds (the step of one batch of "
                 "N x --batch-size examples)");
  app.add_option("--lr-schedule", a.lr_schedule,
                 "learning-rate schedule after the warmup: constant, linear or cosine (to 0 at "
                 "the last step), as transformers' get_*_schedule_with_warmup");
  app.add_option("--warmup-steps", a.warmup_steps, "updates of linear warmup from 0 to --lr");
  app.add_option("--warmup-ratio", a.warmup_ratio,
                 "warmup as a fraction of all updates (instead of --warmup-steps)");
  app.add_option("--steps", a.steps, "optimizer steps (default: one epoch)");
  app.add_option("--epochs", a.epochs, "epochs (when --steps is not given)");
  app.add_option("--dtype", a.dtype, "float32, bfloat16 or float16 (fp32 Adam masters always)");
  app.add_option("--pin", a.pin, "pin_model: alloc, register or off");
  app.add_option("--recompute", a.recompute,
                 "recompute grain: stage, layer, or layer_from_stage (host keeps each backward "
                 "stage's input only; default: the automatic plan chooses)");
  app.add_option("--host-checkpoint-limit", a.host_checkpoint_limit_gib,
                 "host memory a step's activation checkpoints may take, GiB; beyond it the plan "
                 "keeps each backward stage's input only (default: 3/4 of what the host has)");
  app.add_option("--memory-limit", a.memory_limit_gib,
                 "device memory the plan may use, GiB (default: what the device grants)");
  app.add_option(
      "--devices", a.devices,
      "device spec: cuda, cuda:0,1, sim:N; ',mem=24GiB' caps each device's memory as on a "
      "24 GiB card (default: $ROUNDPIPE_DEVICES or auto)");
  app.add_option("--checkpoint-every", a.checkpoint_every,
                 "save a training checkpoint every N steps");
  app.add_option("--checkpoint-dir", a.checkpoint_dir,
                 "training checkpoint directory (default: OUTPUT.ckpt)");
  app.add_flag("--resume", a.resume, "resume from the training checkpoint if there is one");
  app.add_option("--allow-resume-change", a.allow_resume_change,
                 "settings --resume may find changed, comma-separated (steps, epochs, lr, "
                 "lr-schedule, warmup-steps, warmup-ratio, weight-decay, max-grad-norm, "
                 "reduce-dtype); any other change is refused");
  app.add_flag("--overwrite", a.overwrite,
               "replace a model already in --output and an earlier run's training checkpoint");
  bool debug = false;
  app.add_flag("--debug", debug, "print errors with LibTorch's C++ backtrace");
  app.add_flag("--sync-step", a.sync_step, "synchronous optimizer step (default: asynchronous)");
  app.add_option("--loss-chunk", a.loss_chunk,
                 "tokens per chunk of the fused linear + cross-entropy");
  app.add_option("--lora-rank", a.lora_rank,
                 "LoRA: adapters of this rank, every other weight frozen (0: full fine-tuning)");
  app.add_option("--lora-alpha", a.lora_alpha, "LoRA: alpha (scaling = alpha / rank)");
  app.add_option("--lora-dropout", a.lora_dropout, "LoRA: dropout on the adapters' input");
  app.add_option("--lora-targets", a.lora_targets,
                 "LoRA: all-linear, or projections (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                 "down_proj), comma-separated");
  app.add_option("--lora-target-parameters", a.lora_target_parameters,
                 "LoRA: mixture-of-experts weights (mlp.experts.gate_up_proj,"
                 "mlp.experts.down_proj), comma-separated, as peft's target_parameters");
  app.add_flag("--merge", a.merge,
               "LoRA: write the merged full weights instead of the adapter (peft's layout)");
  app.add_option("--quantize-base", a.quantize_base,
                 "QLoRA: the base's projections and experts quantized (nf4 or fp4: 4 bits; int8 "
                 "or fp8: 8 bits) as the checkpoint loads; with --lora-rank");
  app.add_option("--log-every", a.log_every, "steps between progress lines");
  app.add_option("--seed", a.seed, "random seed");
  app.add_option("--reduce-dtype", a.reduce_dtype,
                 "under torchrun (data parallel): dtype of the gradients on the network, float32 "
                 "or bfloat16 (half the bytes)");
  app.add_flag("--shard-optimizer-state", a.shard_optimizer_state,
               "under torchrun: each process keeps the masters and Adam moments of 1/WORLD_SIZE "
               "of the parameters (host memory for the optimizer falls by WORLD_SIZE)");
  app.add_option("--dist-timeout", a.dist_timeout_s,
                 "under torchrun: seconds a process waits for the others before failing");
  CLI11_PARSE(app, argc, argv);
  a.packing = !no_packing;
  try {
    roundpipe::train::run_training(a);
    return 0;
  } catch (const roundpipe::train::TrainingInterrupted& e) {
    std::fprintf(stderr, "roundpipe-train: %s\n", e.what());
    return 128 + e.signal;  // as the shell reports a process a signal ended
  } catch (const std::exception& e) {
    std::fprintf(stderr, "roundpipe-train: error: %s\n",
                 debug ? e.what() : roundpipe::error_message(e).c_str());
    return 1;
  }
}

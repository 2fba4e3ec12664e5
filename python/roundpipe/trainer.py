"""``roundpipe.train``: fine-tune a model on a prepared dataset in a few
lines, with roundpipe-train's controls from Python:

    import roundpipe, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-1.7B", dtype=torch.bfloat16)
    result = roundpipe.train(model, "chats.rpt", roundpipe.TrainingArguments(
        output_dir="out", batch_size=16, lr=2e-5, lr_schedule="cosine", warmup_ratio=0.03,
        max_grad_norm=1.0, eval_fraction=0.02, eval_every=100))

The data is a token file of ``python -m roundpipe.prepare`` (or a list of
:class:`roundpipe.token_file.Example`). Each step trains on ``batch_size x
grad_accum`` examples (packed into rows, or padded), its loss the mean over
the step's labelled tokens; gradients are clipped by their global norm
(``clip_grad_norm_``), AdamW updates the CPU masters while the GPUs run the
next step (``sync_step=True``: after each step), and the learning rate follows
transformers' schedule. Every step's loss, learning rate, gradient norm,
throughput and memory go to ``output_dir/metrics.jsonl`` (what
``python -m roundpipe.plot`` draws), and to TensorBoard when the
``tensorboard`` package is there.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from .run_config import default_num_microbatch
from .token_file import Example, TokenFile


# TrainingArguments.optim: transformers' names (and roundpipe-train's) of
# each optimizer class of roundpipe.optim.
_OPTIMIZERS = {"adamw": "AdamW", "adamw_torch": "AdamW", "adamw_torch_fused": "AdamW",
               "adamw8bit": "AdamW8bit", "adamw_8bit": "AdamW8bit", "adamw_bnb_8bit": "AdamW8bit"}


@dataclass
class TrainingArguments:
    output_dir: str = "roundpipe-out"
    batch_size: int = 8               # examples per forward_backward call
    grad_accum: int = 1               # calls whose gradients one step adds
    max_steps: int = 0                # 0: num_epochs epochs
    num_epochs: int = 1
    lr: float = 2e-5
    lr_schedule: str = "linear"       # constant, linear or cosine (transformers' get_scheduler)
    warmup_steps: int = 0
    warmup_ratio: float = 0.0         # instead of warmup_steps
    weight_decay: float = 0.0         # on matrices; never on norms nor biases
    adam_epsilon: float = 1e-8        # AdamW's eps (transformers' name)
    optim: str = "adamw"              # or "adamw_8bit": bitsandbytes' AdamW8bit (transformers' names)
    max_grad_norm: float = 1.0        # 0: measure the norm, clip nothing
    seq_len: int = 2048               # tokens per example (cut) and per packed row
    packing: bool = True              # pack examples into rows (position_ids), else pad
    num_microbatch: Optional[int] = None
    # Held-out data, evaluated every eval_every steps (0: at the end only)
    # with the weights the next step trains on (an async step's update is
    # still running then), and at the end with the final weights.
    eval_data: Union[None, str, Sequence[Example]] = None
    eval_fraction: float = 0.0        # held out of the training data instead of eval_data
    eval_every: int = 0
    sync_step: bool = False
    seed: int = 0
    log_every: int = 10
    tensorboard: Optional[bool] = None  # None: when the package is there
    save_model: bool = True           # save_pretrained(output_dir) at the end

    def validate(self):
        def need(ok, what):
            if not ok:
                raise ValueError(f"TrainingArguments: {what}")
        need(self.batch_size >= 1, f"batch_size must be at least 1, got {self.batch_size}")
        need(self.grad_accum >= 1, f"grad_accum must be at least 1, got {self.grad_accum}")
        need(self.max_steps >= 0 and self.num_epochs >= 1, "max_steps >= 0 and num_epochs >= 1")
        need(self.lr > 0 and math.isfinite(self.lr), f"lr must be positive, got {self.lr}")
        need(self.lr_schedule in ("constant", "linear", "cosine"),
             f"lr_schedule must be constant, linear or cosine, got {self.lr_schedule!r}")
        need(0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        need(not (self.warmup_steps and self.warmup_ratio), "give warmup_steps or warmup_ratio, not both")
        need(self.max_grad_norm >= 0, f"max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        need(self.optim in _OPTIMIZERS,
             f"optim must be one of {', '.join(sorted(_OPTIMIZERS))}, got {self.optim!r}")
        need(self.seq_len >= 2, f"seq_len must be at least 2, got {self.seq_len}")
        need(self.log_every >= 1, f"log_every must be at least 1, got {self.log_every}")
        need(self.eval_every >= 0, f"eval_every must be >= 0 (0: at the end only), got {self.eval_every}")
        need(0 <= self.eval_fraction < 1, f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        need(not (self.eval_fraction and self.eval_data is not None),
             "give eval_data or eval_fraction, not both")


@dataclass
class TrainResult:
    steps: int = 0
    losses: List[float] = field(default_factory=list)          # each step's mean token loss
    grad_norms: List[float] = field(default_factory=list)      # before clipping
    learning_rates: List[float] = field(default_factory=list)  # of each update
    eval_losses: List[tuple] = field(default_factory=list)     # (step, loss)
    tokens: int = 0
    seconds: float = 0.0
    metrics_path: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def weight_decay_applies(name: str) -> bool:
    """As transformers' Trainer (and roundpipe-train): not norms, not biases."""
    return not name.endswith(".bias") and "norm" not in name


def as_dataset(data, seq_len: int):
    """`data` as the C++ trainer's dataset (``roundpipe._C.Dataset``), its
    examples cut to seq_len: a token file's path, a :class:`TokenFile`, a
    list of :class:`Example`, or a dataset already."""
    from . import _C
    if isinstance(data, _C.Dataset):
        return data
    if isinstance(data, (str, os.PathLike)):
        return _C.TokenFile(os.fspath(data), seq_len)
    if isinstance(data, TokenFile):
        return _C.TokenFile(data.path, seq_len)
    return _C.examples_dataset([(e.input_ids, e.labels) for e in data], seq_len)


def collate(examples: Sequence[Example]) -> dict:
    """One example a row, right padded (attention_mask 0, labels -100):
    roundpipe-train's batching (``roundpipe._C.collate``)."""
    from . import _C
    return _C.collate(as_dataset(examples, 2**62), 0, len(examples))[0]


def pack(examples: Sequence[Example], seq_len: int, min_rows: int = 1) -> dict:
    """The examples packed into rows of at most seq_len tokens and at least
    min_rows rows (longest first, each into the emptiest row it fits),
    position_ids restarting per example and each example's first label
    -100, so that no label crosses into the next (transformers'
    DataCollatorWithFlattening form): roundpipe-train's packing
    (``roundpipe._C.pack``)."""
    from . import _C
    return _C.pack(as_dataset(examples, seq_len), seq_len, min_rows)[0]


def step_data(data, args: TrainingArguments, rows_at_least: int, rank: int = 0, world: int = 1):
    """The run's steps (``roundpipe._C.StepData``, roundpipe-train's): step
    k of an epoch takes the next batch_size x grad_accum examples of a
    shuffle by seed + epoch, packed (at least rows_at_least rows a call) or
    padded; under data parallel each rank takes its share of every call."""
    from . import _C
    return _C.StepData(as_dataset(data, args.seq_len), args.batch_size, args.grad_accum, args.seq_len,
                       args.packing, rows_at_least, args.seed, rank, world)


def step_batches(data, args: TrainingArguments, step: int, rows_at_least: int) -> List[tuple]:
    """The grad_accum batches of `step`, each with its number of tokens."""
    return step_data(data, args, rows_at_least).at(step)[0]


def evaluate(pipe, data, batch_size: int, num_microbatch: Optional[int] = None) -> float:
    """The mean loss over every labelled token of `data` (padded batches,
    in inference mode; one batch in memory at a time): roundpipe-train's
    evaluation."""
    from . import _C
    from .run_config import RoundPipeRunConfig
    data = as_dataset(data, 2**62)
    starts = range(0, len(data), batch_size)
    total = sum(_C.collate(data, b, batch_size)[1] for b in starts)  # (a first pass: the counts)
    if total == 0:
        return float("nan")
    wanted = num_microbatch or pipe.model_run_config.num_microbatch or default_num_microbatch(len(pipe.devices))
    loss = 0.0
    with torch.no_grad():
        for b in starts:
            batch, _ = _C.collate(data, b, batch_size)
            # (A last batch of fewer rows than microbatches runs in fewer.)
            config = RoundPipeRunConfig(num_microbatch=min(batch["input_ids"].shape[0], wanted))
            out = pipe(**batch, num_items_in_batch=total, return_logits=False, roundpipe_run_config=config)
            loss += float(out.loss)
    return loss


def train(model, data, args: Optional[TrainingArguments] = None, **kwargs) -> TrainResult:
    """Trains `model` (a HuggingFace causal LM, peft or not, or a
    RoundPipe made of one) on `data` (a token file path, or examples);
    ``kwargs`` override fields of `args`. Returns the run's losses, norms,
    learning rates and evaluations; the trained weights are the model's
    (saved to output_dir unless save_model=False)."""
    from .roundpipe import RoundPipe
    from .run_config import RoundPipeRunConfig
    from .wrap import wrap_model_to_roundpipe
    from . import optim as rp_optim

    args = args or TrainingArguments()
    for key, value in kwargs.items():
        if not hasattr(args, key):
            raise TypeError(f"train(): unknown argument {key!r}")
        setattr(args, key, value)
    args.validate()
    torch.manual_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    from . import _C
    data = as_dataset(data, args.seq_len)
    eval_data = as_dataset(args.eval_data, args.seq_len) if args.eval_data is not None else None
    if args.eval_fraction:  # roundpipe-train's split: the last of a shuffle by seed + 7919
        data, eval_data = _C.hold_out(data, args.eval_fraction, args.seed)

    if isinstance(model, RoundPipe):
        pipe, hf = model, getattr(model, "model", None)
    else:
        config = RoundPipeRunConfig(num_microbatch=args.num_microbatch) if args.num_microbatch else None
        pipe, hf = wrap_model_to_roundpipe(model, model_run_config=config), model
    rows_at_least = (args.num_microbatch or pipe.model_run_config.num_microbatch
                     or default_num_microbatch(len(pipe.devices)))
    # Data parallel (roundpipe.distributed, e.g. under torchrun): each rank
    # trains on its share of every batch; rank 0 alone writes and prints.
    group = getattr(pipe, "_process_group", None)
    rank, world = (torch.distributed.get_rank(group), torch.distributed.get_world_size(group)) \
        if group is not None else (0, 1)
    if args.batch_size % world:
        raise ValueError(f"TrainingArguments: batch_size {args.batch_size} does not split over {world} processes: "
                         f"make it a multiple of {world} (each process trains on batch_size / {world} examples)")
    writes = rank == 0
    sharded = getattr(pipe, "_shard_optimizer_state", False)  # optim_parameters(): this process's share
    # torchrun sets OMP_NUM_THREADS=1 unless it is set, which leaves the
    # CPU optimizer one core a process (roundpipe-train prints the same).
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cores = os.cpu_count() or 1
    if world > 1 and writes and torch.get_num_threads() == 1 and cores > 2 * local_world:
        print(f"note: this process computes on 1 CPU thread (torchrun sets OMP_NUM_THREADS=1 unless it is "
              f"set); the optimizer runs on the CPU: set OMP_NUM_THREADS={cores // local_world} (the cores "
              f"over the processes of a node)", flush=True)

    decayed, not_decayed = [], []
    for name, p in pipe.optim_named_parameters():
        (decayed if weight_decay_applies(name) else not_decayed).append(p)
    groups = [g for g in (dict(params=decayed, weight_decay=args.weight_decay),
                          dict(params=not_decayed, weight_decay=0.0)) if g["params"]]
    optimizer = getattr(rp_optim, _OPTIMIZERS[args.optim])(groups, lr=args.lr, eps=args.adam_epsilon)
    steps = step_data(data, args, rows_at_least, rank, world)
    total_steps = args.max_steps or args.num_epochs * steps.steps_per_epoch()
    # transformers' schedules (get_scheduler's), roundpipe-train's code.
    schedule = _C.LrSchedule(args.lr_schedule, args.lr, args.warmup_ratio, args.warmup_steps, total_steps)
    params = [p for g in groups for p in g["params"]]

    result = TrainResult(metrics_path=os.path.join(args.output_dir, "metrics.jsonl"))

    # Under data parallel, a step's loss is the mean of the ranks' shares
    # (each a sum over its tokens divided by the step's count / world),
    # found on the optimizer thread after the gradients' average: the
    # collectives of a group run on that one thread, in step order.
    global_losses = {}

    # On the optimizer thread, in step order: clip, update, advance the rate.
    def step_fn(step, local_loss):
        if group is not None:
            total = torch.tensor([local_loss], dtype=torch.float64)
            torch.distributed.all_reduce(total, group=group)
            global_losses[step] = float(total) / world
        grads = [p.grad for p in params if p.grad is not None]
        if sharded:  # this process holds its share of the gradients: the norm is over all shares
            squares = torch.tensor([float(torch.nn.utils.get_total_norm(grads)) ** 2 if grads else 0.0],
                                   dtype=torch.float64)
            torch.distributed.all_reduce(squares, group=group)
            norm = squares.sqrt().float()[0]
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, args.max_grad_norm, norm)
        elif args.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        for g in optimizer.param_groups:
            g["lr"] = schedule.at(step)
        result.learning_rates.append(schedule.at(step))
        result.grad_norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()

    writer = None
    if args.tensorboard is not False and writes:
        try:
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(os.path.join(args.output_dir, "tensorboard"))
        except ImportError:
            if args.tensorboard:
                raise
    # roundpipe-train's metrics.jsonl (C++): a step's line waits for its
    # update's gradient norm and rate; at the end (or on an error) the rest
    # are written without. The lines written go to TensorBoard too.
    metrics = _C.MetricsLog(result.metrics_path if writes else "")

    def write_known(final=False):
        losses = [global_losses[k] for k in range(len(global_losses))] if group is not None else []
        for text in metrics.write_known(list(result.grad_norms), list(result.learning_rates), losses, final):
            line = json.loads(text)
            if writer is None or "loss" not in line or line.get("grad_norm") is None:
                continue
            writer.add_scalar("train/loss", line["loss"], line["step"])
            writer.add_scalar("train/grad_norm", line["grad_norm"], line["step"])
            writer.add_scalar("train/learning_rate", line["lr"], line["step"])

    def run_eval(step):
        if eval_data is None or not writes:
            return
        loss = evaluate(pipe, eval_data, args.batch_size, args.num_microbatch)
        result.eval_losses.append((step, loss))
        metrics.add_eval(step, loss)
        if writer is not None:
            writer.add_scalar("eval/loss", loss, step)

    start = last = time.perf_counter()
    try:
        for step in range(total_steps):
            # Each rank batches its contiguous share of every call's
            # examples; the loss divides by the step's labelled tokens over
            # all shares (counted by StepData: no collective on this
            # thread) over the ranks, whose gradients are then averaged.
            batches, _, items = steps.at(step)
            # (A step whose examples have no labels, cut by seq_len, gets
            # zero loss and gradients rather than 0 / 0.)
            tokens = sum(n for _, n in batches)
            loss = 0.0
            for b, _ in batches:
                loss += float(pipe.forward_backward(
                    input_kwargs=dict(b, num_items_in_batch=max(items, 1) / world)))
            if not math.isfinite(loss):
                raise FloatingPointError(f"the loss is {loss} at step {step + 1}: training diverged "
                                         "(lower lr, or train in float32)")
            pipe.step(functools.partial(step_fn, step, loss), is_async=not args.sync_step)
            now = time.perf_counter()
            result.tokens += tokens
            result.losses.append(loss)
            line = dict(step=step + 1, loss=loss, tokens=tokens, loss_tokens=items,
                        seconds=now - last, tokens_per_second=tokens / max(now - last, 1e-9),
                        device_peak_bytes=int(torch.cuda.max_memory_allocated())
                        if torch.cuda.is_available() else 0)
            last = now
            metrics.add_step(json.dumps(line))
            if writer is not None:
                writer.add_scalar("train/tokens_per_second", line["tokens_per_second"], step + 1)
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < total_steps:
                run_eval(step + 1)
                last = time.perf_counter()  # (evaluations count for no step's time)
            write_known()
            if writes and ((step + 1) % args.log_every == 0 or step + 1 == total_steps):
                # The newest norm known (an async step's arrives during the
                # next); under data parallel the loss is the newest known too.
                norms = list(result.grad_norms)
                norm = f"  grad norm {norms[-1]:.3g} (step {len(norms)})" if norms else ""
                shown = f"{loss:.4f}" if group is None else \
                    (f"{global_losses[len(norms) - 1]:.4f} (step {len(norms)})" if norms else "-")
                print(f"step {step + 1}/{total_steps}  loss {shown}{norm}  "
                      f"{line['tokens_per_second'] * world:.0f} tokens/s", flush=True)
        pipe.synchronize()
        if group is not None:
            result.losses = [global_losses[k] for k in range(total_steps)]
        run_eval(total_steps)
        write_known()
    finally:
        write_known(final=True)
        if writer is not None:
            writer.close()
    result.steps = total_steps
    result.seconds = time.perf_counter() - start
    if args.save_model and writes and hf is not None and hasattr(hf, "save_pretrained"):
        hf.save_pretrained(args.output_dir)
    return result


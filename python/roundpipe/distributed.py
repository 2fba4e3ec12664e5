"""Data parallelism across processes on torch.distributed (issue 21): each
process runs its own RoundPipe over its own devices on its own shard of the
batch, and every step averages the gradients over the processes of a group
(DDP's mean over ranks), so every process takes the same step.

A RoundPipe hands its group to the C++ engine, which reduces the gradients
bucket by bucket while backward still runs, on a Gloo group of its own
(engine_group) made from the one passed as ``process_group=``, else the
default group when torch.distributed is initialised (``torchrun`` sets it
up), else none. With ``shard_optimizer_state=True`` each process keeps the
masters and optimizer state of about 1/N of the parameters, and the owners
broadcast the new weights (Note [Sharded optimizer state] in
src/runtime/parallel/gradient_averager.h). ``save_sharded`` / ``load_sharded`` write
and read a checkpoint as one file per process, keyed by parameter name, so
that it resumes with any number of processes.

Automatic wrapping (several RoundPipes and glue on the CPU) averages here
instead (average_gradients), once every part's gradients are in.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Optional

import torch

BUCKET_BYTES = 64 << 20  # gradients per all-reduce call


def resolve_group(process_group):
    """The group to average over, or None (one process, nothing to do;
    process_group=False: none even under torch.distributed)."""
    import torch.distributed as dist

    if process_group is False:
        return None
    if process_group is None:
        init_from_environment()
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    return process_group if dist.get_world_size(process_group) > 1 else None


def init_from_environment() -> None:
    """Under torchrun (WORLD_SIZE > 1 in the environment, with RANK,
    MASTER_ADDR and MASTER_PORT) and no process group yet: the default
    group, on Gloo (the gradients and masters it averages are in CPU
    memory), so that a one-process script runs unchanged."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group("gloo")


def engine_group(group):
    """A Gloo group of the processes of `group`, with its timeout, for one
    RoundPipe's engine: its optimizer thread issues collectives while the
    caller's thread may use `group` (two threads on one group could pair
    different collectives across processes), and the gradients are in CPU
    memory (which NCCL does not take). Every process of the default group
    makes it (torch's new_group), in the same order."""
    import torch.distributed as dist

    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        timeout = None  # no Gloo backend in `group`: torch's default
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo", timeout=timeout)


def check_same_weights(parameters, group, what: str) -> None:
    """Every process must start from the same weights (the same checkpoint,
    or the same seed): a few numbers per parameter are compared across the
    group, and a difference is an error naming the first parameter that
    differs, before anything trains on diverged replicas."""
    import torch.distributed as dist

    named = [(n, p) for n, p in parameters]
    if not named:
        return
    probe = torch.stack([p.detach().reshape(-1)[:64].double().sum() + p.detach().double().abs().sum()
                         if p.numel() else torch.zeros((), dtype=torch.float64) for _, p in named])
    low, high = probe.clone(), probe.clone()
    try:
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as e:
        raise describe_failure(e, group, "comparing the starting weights") from e
    differs = (high - low).abs() > 1e-9 * high.abs().clamp_min(1.0)
    if differs.any():
        name = named[int(differs.nonzero()[0])][0]
        raise ValueError(
            f"{what}: the processes of the group start from different weights ('{name}' differs): "
            "load the same checkpoint on every rank, or seed every rank alike (torch.manual_seed) "
            "before making the model")


def _reduce_in(flat, reduce_dtype, world, reduce):
    """`reduce` (a collective summing in place) of flat / world, sent in
    reduce_dtype (None: flat's own); returns the mean in flat's dtype."""
    sent = (flat / world).to(reduce_dtype) if reduce_dtype not in (None, flat.dtype) else flat.div_(world)
    reduce(sent)
    return sent.to(flat.dtype) if sent.dtype != flat.dtype else sent


def average_gradients(parameters, group, reduce_dtype=None) -> None:
    """Averages the parameters' .grad over the group in place (a missing
    gradient counts as zeros, so that every rank sends the same buckets);
    reduce_dtype: the dtype on the wire (torch.bfloat16: half the bytes of
    float32 gradients, each rank's share rounded to 8 bits of mantissa
    before the sum)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    for indices, flat in _flat_buckets(grads, lambda g: g):
        flat = _reduce_in(flat, reduce_dtype, world, lambda t: dist.all_reduce(t, group=group))
        _unflatten(flat, [grads[i] for i in indices])


def _flat_buckets(tensors, of):
    """`tensors` in flat buckets of one dtype and about BUCKET_BYTES each,
    in order: (their indices, the tensors `of(t)` concatenated)."""
    bucket, size = [], 0
    for i in list(range(len(tensors))) + [None]:
        if i is not None:
            bucket.append(i)
            size += tensors[i].numel() * tensors[i].element_size()
            if size < BUCKET_BYTES:
                continue
        by_dtype = {}
        for j in bucket:
            by_dtype.setdefault(tensors[j].dtype, []).append(j)
        for same in by_dtype.values():
            yield same, torch.cat([of(tensors[j]).reshape(-1) for j in same])
        bucket, size = [], 0


def _unflatten(flat, tensors):
    """Copies the consecutive parts of `flat` into `tensors`."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def describe_failure(error: Exception, group: Optional[object], doing: str) -> RuntimeError:
    """The error of a collective with what the user can do about it."""
    import torch.distributed as dist

    return RuntimeError(
        f"{doing} over the {dist.get_world_size(group)} processes of the group failed: {error}. "
        "Another process probably stopped or is behind (each must make its RoundPipe and call step() "
        "as often as the others); the group's timeout (init_process_group(timeout=...)) bounds the wait")


_SHARD_FILE = "optimizer-rank{rank:05d}-of-{world:05d}.pt"


def _world_and_rank(pipe):
    import torch.distributed as dist

    group = getattr(pipe, "_process_group", None)
    return (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)


def save_sharded(pipe, optimizer, directory) -> str:
    """Writes this process's part of a training checkpoint into `directory`
    (every process calls it, after the same step): for its part of the
    masters (sharded: the ones it keeps; replicated: every N-th), the
    master, the weight the next call would run on and the optimizer's
    state, by parameter name; rank 0 adds the buffers. Waits for the pending
    step but publishes nothing (an async run stays one update behind, and
    load_sharded restores that). Returns the file written."""
    world, rank = _world_and_rank(pipe)
    ahead = pipe._engine.wait_for_background_work()
    masters = dict(pipe._engine.optim_named_parameters())  # sharded: this process's
    weights = dict(pipe._engine.named_parameters())
    names = list(masters)
    mine = set(names if getattr(pipe, "_shard_optimizer_state", False) else names[rank::world])
    by_id = {id(m): n for n, m in masters.items()}
    states, groups = {}, []
    for g in optimizer.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params"})
        for p in g["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise ValueError("save_sharded: the optimizer holds a tensor that is not one of this "
                                 "RoundPipe's optim_parameters(); build it on pipe.optim_parameters()")
            if name in mine and p in optimizer.state:
                states[name] = {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
    part = {
        "world": world, "rank": rank, "ahead": bool(ahead), "param_groups": groups,
        "masters": {n: masters[n].detach().clone() for n in names if n in mine},
        "weights": {n: weights[n].detach().clone() for n in names if n in mine},
        "state": states,
        "buffers": ({n: b.detach().clone() for n, b in pipe._engine.named_buffers()} if rank == 0 else {}),
    }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, _SHARD_FILE.format(rank=rank, world=world))
    torch.save(part, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write leaves the last complete file
    return path


def load_sharded(pipe, optimizer, directory) -> None:
    """Restores a checkpoint that save_sharded wrote with any number of
    processes into this RoundPipe (before its first call) and `optimizer`
    (built on its optim_parameters()): every weight from all the files, the
    masters and optimizer state this process keeps, and the pending update
    of an async run (every process calls it)."""
    files = sorted(glob.glob(os.path.join(directory, "optimizer-rank*-of-*.pt")))
    found = {}
    for f in files:
        m = re.search(r"rank(\d+)-of-(\d+)\.pt$", f)
        found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    complete = [w for w, ranks in found.items() if sorted(ranks) == list(range(w))]
    if len(complete) != 1:
        raise FileNotFoundError(
            f"load_sharded: {directory} holds no single complete set of optimizer shards "
            f"(found {', '.join(f'{len(r)} of {w}' for w, r in sorted(found.items())) or 'none'}); "
            "point it at the directory every process of one run saved into")
    parts = [torch.load(found[complete[0]][r], weights_only=False) for r in range(complete[0])]
    masters = dict(pipe._engine.optim_named_parameters())  # sharded: this process's
    weights = dict(pipe._engine.named_parameters())
    buffers = dict(pipe._engine.named_buffers())
    trainable = [n for n, w in weights.items() if w.requires_grad]
    saved = {}
    for part in parts:
        for name in part["masters"]:
            saved[name] = part
    missing = [n for n in trainable if n not in saved]
    if missing or len(saved) != len(trainable):
        raise ValueError(f"load_sharded: the checkpoint's parameters differ from this model's "
                         f"(missing: {missing[:3]}, extra: {sorted(set(saved) - set(trainable))[:3]})")
    with torch.no_grad():
        for name in trainable:
            weights[name].copy_(saved[name]["weights"][name])
        for name, master in masters.items():
            master.copy_(saved[name]["masters"][name])
        for name, b in parts[0]["buffers"].items():
            buffers[name].copy_(b)
    by_id = {id(m): n for n, m in masters.items()}
    for g, saved_group in zip(optimizer.param_groups, parts[0]["param_groups"]):
        g.update({k: v for k, v in saved_group.items() if k in g})
        for p in g["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise ValueError("load_sharded: the optimizer holds a tensor that is not one of this "
                                 "RoundPipe's optim_parameters(); build it on pipe.optim_parameters()")
            state = saved[name]["state"].get(name)
            if state is not None:
                optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    if parts[0]["ahead"]:
        pipe._engine.restore_pending_update()

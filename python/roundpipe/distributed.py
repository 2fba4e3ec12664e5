"""Data parallelism across processes on torch.distributed (issue 21, first
slice): each process runs its own RoundPipe over its own devices on its own
shard of the batch; before every optimizer step the masters' gradients are
averaged over the processes of the group (a sum all-reduce in flat buckets,
divided by the group's size: DDP's mean over ranks), so every process takes
the same step and the weights stay identical.

The group is the one passed as ``process_group=``, else the default group
when torch.distributed is initialised (``torchrun`` sets it up), else none.

With ``shard_optimizer_state=True`` (ZeRO's stage 1 on the host, with the
gradients of a step sharded too) each process owns a contiguous run of
about 1/N of the masters' bytes (OptimizerShards): ``optim_parameters()``
gives only those, so the user's optimizer keeps moments for 1/N of the
parameters; a step reduces each gradient to its owner (the mean), drops
the others, runs the user's step, and broadcasts each owner's new masters
to every process, which then publishes identical weights as before.
``save_sharded`` / ``load_sharded`` write and read a checkpoint as one file
per process, keyed by parameter name, so that it resumes with any number of
processes.
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


class OptimizerShards:
    """Which process owns which masters: the masters in the engine's order
    (the same on every rank: check_same_weights), cut into `world`
    contiguous runs of about equal bytes; master i goes to the rank its
    middle byte falls in."""

    def __init__(self, named_masters, group, reduce_dtype=None):
        import torch.distributed as dist

        self.group, self.reduce_dtype = group, reduce_dtype
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.names = [n for n, _ in named_masters]
        self.masters = [m for _, m in named_masters]
        sizes = [m.numel() * m.element_size() for m in self.masters]
        total, before, self.owner = max(sum(sizes), 1), 0, []
        for size in sizes:
            self.owner.append(min(self.world - 1, (2 * before + size) * self.world // (2 * total)))
            before += size

    def owned(self, rank=None):
        rank = self.rank if rank is None else rank
        return [i for i, o in enumerate(self.owner) if o == rank]

    def _global(self, rank):
        import torch.distributed as dist

        return dist.get_global_rank(self.group, rank)

    def _buckets(self, rank, of):
        """Rank `rank`'s masters in flat buckets (_flat_buckets): (master
        indices, the tensors `of(master)` concatenated)."""
        mine = self.owned(rank)
        for positions, flat in _flat_buckets([self.masters[i] for i in mine], of):
            yield [mine[p] for p in positions], flat

    def reduce_gradients(self):
        """Each master's gradient, averaged over the group, on its owner (a
        missing gradient counts as zeros); the others' are dropped."""
        import torch.distributed as dist

        def grad_of(m):
            return m.grad if m.grad is not None else torch.zeros_like(m)

        for rank in range(self.world):
            for indices, flat in self._buckets(rank, grad_of):
                flat = _reduce_in(flat, self.reduce_dtype, self.world,
                                  lambda t: dist.reduce(t, dst=self._global(rank), group=self.group))
                if rank == self.rank:
                    for i in indices:
                        if self.masters[i].grad is None:
                            self.masters[i].grad = torch.zeros_like(self.masters[i])
                    _unflatten(flat, [self.masters[i].grad for i in indices])
        for i, m in enumerate(self.masters):
            if self.owner[i] != self.rank:
                m.grad = None

    def broadcast_masters(self):
        """Every owner's (just updated) masters to every process."""
        import torch.distributed as dist

        for rank in range(self.world):
            for indices, flat in self._buckets(rank, lambda m: m.detach()):
                dist.broadcast(flat, src=self._global(rank), group=self.group)
                if rank != self.rank:
                    with torch.no_grad():
                        _unflatten(flat, [self.masters[i] for i in indices])


_SHARD_FILE = "optimizer-rank{rank:05d}-of-{world:05d}.pt"


def save_sharded(pipe, optimizer, directory) -> str:
    """Writes this process's part of a training checkpoint into `directory`
    (every process calls it, after the same step): for the masters it owns,
    the master, the weight the next call would run on and the optimizer's
    state, by parameter name; rank 0 adds the buffers. Waits for the pending
    step but publishes nothing (an async run stays one update behind, and
    load_sharded restores that). Returns the file written."""
    shards = pipe._optimizer_shards()
    ahead = pipe._engine.wait_for_background_work()
    weights = dict(pipe._engine.named_parameters())
    by_master = {id(p): i for i, p in enumerate(shards.masters)}
    states, groups = {}, []
    for g in optimizer.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params"})
        for p in g["params"]:
            i = by_master.get(id(p))
            if i is None:
                raise ValueError("save_sharded: the optimizer holds a tensor that is not one of this "
                                 "RoundPipe's optim_parameters(); build it on pipe.optim_parameters()")
            if p in optimizer.state:
                states[shards.names[i]] = {k: v.clone() if torch.is_tensor(v) else v
                                           for k, v in optimizer.state[p].items()}
    part = {
        "world": shards.world, "rank": shards.rank, "ahead": bool(ahead), "param_groups": groups,
        "masters": {shards.names[i]: shards.masters[i].detach().clone() for i in shards.owned()},
        "weights": {shards.names[i]: weights[shards.names[i]].detach().clone() for i in shards.owned()},
        "state": states,
        "buffers": ({n: b.detach().clone() for n, b in pipe._engine.named_buffers()}
                    if shards.rank == 0 else {}),
    }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, _SHARD_FILE.format(rank=shards.rank, world=shards.world))
    torch.save(part, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write leaves the last complete file
    return path


def load_sharded(pipe, optimizer, directory) -> None:
    """Restores a checkpoint that save_sharded wrote with any number of
    processes into this RoundPipe (before its first call) and `optimizer`
    (built on its optim_parameters()): every weight and master from all the
    files, the optimizer's state for the masters this process owns, and the
    pending update of an async run."""
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
    shards = pipe._optimizer_shards()
    weights = dict(pipe._engine.named_parameters())
    buffers = dict(pipe._engine.named_buffers())
    saved = {}
    for part in parts:
        for name in part["masters"]:
            saved[name] = part
    missing = [n for n in shards.names if n not in saved]
    if missing or len(saved) != len(shards.names):
        raise ValueError(f"load_sharded: the checkpoint's parameters differ from this model's "
                         f"(missing: {missing[:3]}, extra: {sorted(set(saved) - set(shards.names))[:3]})")
    with torch.no_grad():
        for name, master in zip(shards.names, shards.masters):
            weights[name].copy_(saved[name]["weights"][name])
            master.copy_(saved[name]["masters"][name])
        for name, b in parts[0]["buffers"].items():
            buffers[name].copy_(b)
    mine = {id(shards.masters[i]): shards.names[i] for i in shards.owned()}
    for g, saved_group in zip(optimizer.param_groups, parts[0]["param_groups"]):
        g.update({k: v for k, v in saved_group.items() if k in g})
        for p in g["params"]:
            name = mine.get(id(p))
            if name is None:
                raise ValueError("load_sharded: the optimizer holds a tensor that is not one of this "
                                 "RoundPipe's optim_parameters(); build it on pipe.optim_parameters()")
            state = saved[name]["state"].get(name)
            if state is not None:
                optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    if parts[0]["ahead"]:
        pipe._engine.restore_pending_update()

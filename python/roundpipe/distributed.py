"""Data parallelism across processes on torch.distributed (issue 21, first
slice): each process runs its own RoundPipe over its own devices on its own
shard of the batch; before every optimizer step the masters' gradients are
averaged over the processes of the group (a sum all-reduce in flat buckets,
divided by the group's size: DDP's mean over ranks), so every process takes
the same step and the weights stay identical.

The group is the one passed as ``process_group=``, else the default group
when torch.distributed is initialised (``torchrun`` sets it up), else none.
"""
from __future__ import annotations

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
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    return process_group if dist.get_world_size(process_group) > 1 else None


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


def average_gradients(parameters, group) -> None:
    """Averages the parameters' .grad over the group in place (a missing
    gradient counts as zeros, so that every rank sends the same buckets)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for p in params + [None]:
        if p is not None:
            bucket.append(p)
            size += p.grad.numel() * p.grad.element_size()
            if size < BUCKET_BYTES:
                continue
        if not bucket:
            break
        by_dtype = {}
        for q in bucket:
            by_dtype.setdefault(q.grad.dtype, []).append(q)
        for same in by_dtype.values():
            flat = torch.cat([q.grad.reshape(-1) for q in same])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            offset = 0
            for q in same:
                n = q.grad.numel()
                q.grad.copy_(flat[offset:offset + n].view_as(q.grad))
                offset += n
        bucket, size = [], 0


def describe_failure(error: Exception, group: Optional[object], doing: str) -> RuntimeError:
    """The error of a collective with what the user can do about it."""
    import torch.distributed as dist

    return RuntimeError(
        f"{doing} over the {dist.get_world_size(group)} processes of the group failed: {error}. "
        "Another process probably stopped or is behind (each must make its RoundPipe and call step() "
        "as often as the others); the group's timeout (init_process_group(timeout=...)) bounds the wait")

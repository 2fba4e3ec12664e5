"""The original's automatic wrapping of a model without a preset
(wrap_model_to_roundpipe(..., use_sequential_preset=False)): children
above the size threshold become RoundPipes, smaller ones run as one, and
the parent's forward stays on the CPU (AutoRoundPipe)."""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Optional

import torch
from torch import nn

from . import distributed
from ._layer_copy import DISPATCH_MARK
from ._pass_through import PassThroughToModel
from .roundpipe import RoundPipe, in_step_function
from .run_config import RoundPipeRunConfig

def _param_bytes(module: nn.Module, recurse: bool = True) -> int:
    seen, total = set(), 0
    for p in list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse)):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


class AutoRoundPipe(PassThroughToModel, nn.Module):
    """A model that could not become one Sequential, with its large
    submodules each run by a RoundPipe while the glue code of the original
    forward and the small modules run on the CPU.

    As in the original: no ``forward_backward`` (train with
    ``loss.backward()``), no pipeline scheduling across the wrapped parts.
    ``step`` is asynchronous like RoundPipe's: each part's RoundPipe adds
    its gradients into its masters on its optimizer thread; once all have,
    ``step_fn`` runs once over every master (the parts' and the glue's),
    and each part publishes its new weights while the next iteration runs
    on the ones before (one update old, as RoundPipe); the glue's new
    weights are copied in at the next ``step()`` or ``synchronize()``."""

    def __init__(self, model: nn.Module, pipes: list, optim_dtype: Optional[torch.dtype], process_group=None,
                 reduce_dtype: Optional[torch.dtype] = None):
        super().__init__()
        object.__setattr__(self, "_process_group", process_group)  # (the parts have none)
        object.__setattr__(self, "_reduce_dtype", reduce_dtype)
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_pipes", pipes)
        object.__setattr__(self, "_optim_dtype", optim_dtype)
        object.__setattr__(self, "_glue_masters", None)
        object.__setattr__(self, "_pending", None)  # the glue's last step: (event, failure list)
        object.__setattr__(self, "_lock", threading.Lock())

    @property
    def pipes(self) -> list:
        return list(self._pipes)

    def forward(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def synchronize(self) -> None:
        """Finishes every part's pending step and transfers, and copies the
        glue's latest weights in (as RoundPipe.synchronize)."""
        for pipe in self._pipes:
            pipe.synchronize()
        self._publish_glue()

    def _glue(self):
        """The trainable parameters no part's RoundPipe runs: (name, param)."""
        inside = {id(p) for pipe in self._pipes for p in pipe.original_model.parameters()}
        return [(n, p) for n, p in self._model.named_parameters()
                if p.requires_grad and id(p) not in inside]

    def _glue_named_masters(self) -> list:
        with self._lock:
            if self._glue_masters is None:
                masters = []
                for n, p in self._glue():
                    dtype = self._optim_dtype or p.dtype
                    masters.append((n, p, p.detach().to(dtype, copy=True).requires_grad_(True)))
                object.__setattr__(self, "_glue_masters", masters)
        return list(self._glue_masters)

    def optim_named_parameters(self, prefix: str = "", remove_duplicate: bool = True):
        """An iterator over (name, master) pairs: each part's RoundPipe's
        masters (named from the model's root), then the glue's."""
        return iter(self._optim_named_list(prefix, remove_duplicate))

    def optim_parameters(self):
        return iter(self._optim_list())

    def _optim_named_list(self, prefix: str = "", remove_duplicate: bool = True) -> list:
        named = []
        for pipe in self._pipes:
            dot = pipe.name + "." if pipe.name else ""
            named += [(dot + n, m) for n, m in pipe._optim_named_list(remove_duplicate=remove_duplicate)]
        named += [(n, m) for n, _, m in self._glue_named_masters()]
        dot = prefix + "." if prefix else ""
        return [(dot + n, m) for n, m in named]

    def _optim_list(self) -> list:
        return [m for _, m in self._optim_named_list()]

    def _publish_glue(self) -> None:
        """Waits for the last step and copies the glue's new weights in."""
        pending = self._pending
        if pending is None:
            return
        object.__setattr__(self, "_pending", None)
        done, failure = pending
        done.wait()
        if failure:
            raise failure[0]
        with torch.no_grad():
            for _, p, m in self._glue_named_masters():
                p.copy_(m)

    def step(self, step_fn, is_async: bool = True, *args, **kwargs) -> None:
        """One optimizer step over every master. The parts' gradients go in
        on their optimizer threads; the glue's are taken now. Async: returns
        at once (the next iteration runs on the weights before this step);
        sync: returns with every weight updated. (An optimizer given as
        ``step_fn`` steps as ``optimizer.step(); optimizer.zero_grad()``.)"""
        if isinstance(step_fn, torch.optim.Optimizer) and not (args or kwargs):
            optimizer = step_fn
            step_fn = lambda: (optimizer.step(), optimizer.zero_grad())  # noqa: E731
        if not callable(step_fn):
            raise TypeError("step() takes a function that steps the optimizer, e.g. "
                            "lambda: (opt.step(), opt.zero_grad())")
        if args or kwargs:
            step_fn = functools.partial(step_fn, *args, **kwargs)
        self._publish_glue()
        glue = self._glue_named_masters()
        group, masters = self._process_group, self._optim_list()
        grads = []
        for _, p, m in glue:
            grads.append(p.grad)
            p.grad = None
        done, failure = threading.Event(), []

        def update():
            try:
                with torch.no_grad():
                    for (_, _, m), g in zip(glue, grads):
                        if g is not None:
                            g = g.to(m.dtype)
                            m.grad = g if m.grad is None else m.grad.add_(g)
                if group is not None:
                    # Every master, the parts' and the glue's, in one order
                    # and on this one thread (roundpipe.distributed).
                    try:
                        distributed.average_gradients(masters, group, self._reduce_dtype)
                    except RuntimeError as e:
                        raise distributed.describe_failure(e, group, "averaging the gradients") from e
                in_step_function(step_fn)()
            except BaseException as e:  # noqa: BLE001 - handed to every part and to the caller
                failure.append(e)
                raise
            finally:
                done.set()

        object.__setattr__(self, "_pending", (done, failure))
        if not self._pipes:
            update()
            self._publish_glue()
            return
        # Runs `update` once every part's gradients are in its masters.
        barrier = threading.Barrier(len(self._pipes), action=update)

        def part_step():
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                raise failure[0] if failure else RuntimeError("another part's step failed")

        try:
            for pipe in self._pipes:
                pipe.step(part_step, is_async=True)
        except BaseException as e:
            # A part refused the step (an earlier call of it failed): the
            # parts already queued must not wait for it.
            failure.append(e)
            barrier.abort()
            done.set()
            object.__setattr__(self, "_pending", None)
            raise
        if not is_async:
            self.synchronize()


def _skipped(module, path, skip) -> bool:
    """skip_modules names a module by itself, its path or its class name."""
    return any(s is module for s in skip if isinstance(s, nn.Module)) or any(
        isinstance(s, str) and (s == path or s == type(module).__name__) for s in skip)


def _wrap_whole(module, path, pipes, kwargs, configs):
    """Runs `module`'s forward through a RoundPipe of its own (an
    nn.Sequential: one layer per child)."""
    config = configs.get(id(module))
    args = dict(kwargs)
    if config is not None:
        args["model_run_config"] = config
    pipe = RoundPipe(module, name=path or type(module).__name__, **args)
    pipes.append(pipe)

    def dispatch(*a, **kw):
        return pipe(*a, **kw)

    setattr(dispatch, DISPATCH_MARK, True)
    module.__dict__["forward"] = dispatch


def _auto_wrap(module, lower, upper, skip, pipes, kwargs, configs, path=""):
    """Gives parts of `module` RoundPipes by the original's rules, first
    match wins: skipped modules stay as they are; an nn.Sequential becomes
    one multi-layer RoundPipe; a module with a forward of its own whose own
    parameters and buffers reach `lower` bytes, or whose whole size is at
    most `upper`, one single-layer RoundPipe (below `lower` in all, and
    with no config of the caller's, with num_microbatch=1: too small to
    pipeline); a ModuleList's items one each, chained as in the original:
    every item but the last returns its microbatches unmerged
    (merge_output=False, unless override_config says otherwise), which the
    next item takes as they are (glue code that computes with them gets
    them merged: PackedMicrobatches); else its children are visited, the
    module's own forward staying on the CPU. `configs`: id(module) -> its
    RoundPipeRunConfig (override_config)."""
    if _skipped(module, path, skip):
        return
    join = lambda name: f"{path}.{name}" if path else name  # noqa: E731
    if isinstance(module, nn.Sequential):
        _wrap_whole(module, path, pipes, kwargs, configs)
        return
    size = _param_bytes(module)
    own = _param_bytes(module, recurse=False)
    has_forward = type(module).forward is not nn.Module.forward
    if has_forward and (own >= lower or size <= upper):
        if size < lower and id(module) not in configs:
            base = kwargs.get("model_run_config") or RoundPipeRunConfig()
            configs = {**configs, id(module): dataclasses.replace(base, num_microbatch=1)}
        _wrap_whole(module, path, pipes, kwargs, configs)
        return
    if isinstance(module, nn.ModuleList):
        items = list(module.named_children())
        for i, (name, child) in enumerate(items):
            chained = dict(configs)
            if i + 1 < len(items) and id(child) not in configs:
                base = kwargs.get("model_run_config") or RoundPipeRunConfig()
                chained[id(child)] = dataclasses.replace(base, merge_output=False)
            _wrap_whole(child, join(name), pipes, kwargs, chained)
        return
    for name, child in module.named_children():
        _auto_wrap(child, lower, upper, skip, pipes, kwargs, configs, join(name))

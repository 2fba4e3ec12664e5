"""RoundPipe: train a model bigger than GPU memory on the C++ engine."""
from __future__ import annotations

import functools
import os
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from . import _C, _specs, distributed
from ._pass_through import PassThroughToModel
from .batch import PackedMicrobatches, _pack_leaves, _packed_microbatches
from .run_config import RoundPipeRunConfig
from .timer import ModelTimer

_optimizer_ctx = threading.local()
# Every RoundPipe alive, so that work still in flight finishes at exit.
_live_roundpipes: "weakref.WeakSet[RoundPipe]" = weakref.WeakSet()


class _ClosedEngine:
    """Stands for an engine closed at interpreter exit."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attribute):
        raise RuntimeError(f"RoundPipe {self.name} was closed at interpreter exit "
                           f"(its engine is gone); it cannot {attribute} now")


# id(parameter) -> the live RoundPipe that owns it: each keeps its own
# master copy and publishes its own updates, so a parameter in two of them
# would be trained twice over, each undoing the other.
_parameter_owners: "weakref.WeakValueDictionary[int, RoundPipe]" = weakref.WeakValueDictionary()


def _claim_parameters(pipe, model: nn.Module) -> None:
    owned = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        other = _parameter_owners.get(id(p))
        if other is not None and other is not pipe:
            raise ValueError(
                f"parameter {name!r} already belongs to another live RoundPipe ({other.name}): a "
                "parameter shared by two RoundPipes would get two optimizer copies and two "
                "updates. Wrap the modules that share it in one RoundPipe (e.g. one nn.Sequential), "
                "or give each its own copy")
        owned[id(p)] = p
    for key in owned:
        _parameter_owners[key] = pipe


class OptimizerCtx:
    """Inside ``with OptimizerCtx():`` a RoundPipe's ``parameters()`` and
    ``named_parameters()`` return the optimizer's master copies, so existing
    code that builds an optimizer from ``model.parameters()`` works."""

    def __enter__(self):
        _optimizer_ctx.depth = getattr(_optimizer_ctx, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        _optimizer_ctx.depth -= 1
        return False


_step_function = threading.local()


def in_step_function(step_fn):
    """`step_fn`, marked while it runs as a step function (on whatever
    thread runs it): GradScaler.unscale_ is only meaningful there."""
    def run(*args):
        from .grad_scaler import run_unscales_asked_outside

        _step_function.depth = getattr(_step_function, "depth", 0) + 1
        try:
            run_unscales_asked_outside()
            return step_fn(*args)
        finally:
            _step_function.depth -= 1
    return run


def inside_step_function() -> bool:
    return getattr(_step_function, "depth", 0) > 0


def _in_optimizer_ctx() -> bool:
    return getattr(_optimizer_ctx, "depth", 0) > 0


def __getattr__(name):
    # The original defines AutoRoundPipe in this module (roundpipe.roundpipe).
    if name == "AutoRoundPipe":
        from .auto_wrap import AutoRoundPipe

        return AutoRoundPipe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _call_site() -> str:
    """The original's default name: file:line of the code that made the
    RoundPipe (the first frame outside this package)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package:
        frame = frame.f_back
    if frame is None:
        return "RoundPipe"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _warn_model_parameters():
    # As the original's: an optimizer built on these would step the model's
    # own tensors, which RoundPipe overwrites with its masters' values.
    warnings.warn("RoundPipe.parameters() outside OptimizerCtx gives the model's parameters; an "
                  "optimizer must take optim_parameters() (or be built inside `with OptimizerCtx():`)",
                  UserWarning, stacklevel=3)


def _default_loss_fn(output, label):
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output
    raise TypeError(
        f"forward_backward needs loss_fn(output, label) -> 0-dim tensor: the model returns "
        f"{type(output).__name__}, which is neither a loss tensor nor has a .loss"
    )


def _resolve(call: Optional[RoundPipeRunConfig], model: RoundPipeRunConfig, name: str):
    value = getattr(call, name) if call is not None else None
    return getattr(model, name) if value is None else value


class RoundPipe(PassThroughToModel, nn.Module):
    """Wraps `model` for training with model state in CPU memory.

    ``nn.Sequential``: each child is one scheduled layer; any other module is
    one layer. Layer 0 gets the call's ``(*args, **kwargs)``; every later
    layer gets the previous layer's whole output (any pytree).

    - optim_dtype: dtype of the optimizer's master copies (default: the
      parameter dtype), e.g. torch.float32 for a float16 model
    - model_run_config: the model-level RoundPipeRunConfig
    - pin_model: "alloc" (pinned copies, fastest), "register" (pin in place,
      CUDA only) or "off" (pageable; e.g. mmap-loaded weights)
    - devices: device spec ("cuda", "cuda:0,1", "sim:2", ...); default:
      $ROUNDPIPE_DEVICES, else all GPUs, else one simulated device
    - model_memory_limit: device memory (GiB) the automatic plan may use per
      device (default: what the smallest device has left); verbose: log the
      automatic plan with its predicted stage times and memory
    - process_group: data parallelism over processes (roundpipe.distributed):
      each process feeds its own shard, and every step averages the
      gradients over the group, bucket by bucket while backward still runs.
      Default: torch.distributed's default group when it is initialised
      (torchrun), else none; False: none. Every process of the default
      group must build its RoundPipes in the same order (each makes a Gloo
      group of its own for the engine)
    - shard_optimizer_state: with a process group, each process keeps the
      masters of about 1/N of the parameters (optim_parameters() gives
      those, so the optimizer keeps state for them alone); each gradient
      bucket is reduced to its owner, which broadcasts the updated weights;
      checkpoint with roundpipe.distributed.save_sharded / load_sharded.
      A step function sees only its share of the gradients: a gradient
      norm or an inf check in it is not the whole model's
    - reduce_dtype: the dtype gradients cross the network in (default:
      float32); torch.bfloat16 halves the bytes
    - host_checkpoint_limit (keyword): host memory (GiB) a training call's
      activation checkpoints may take where the plan chooses the recompute
      grain (default: three quarters of what the host has available);
      beyond it calls keep each backward stage's input only
      (recompute_grain "layer_from_stage"; pipeline_stats()
      ["calls_with_thin_checkpoints"] counts them)

    Attributes the wrapper lacks are read from the original model (e.g.
    ``model.config``); writes go to both.
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: Optional[torch.dtype] = None,
        name: Optional[str] = None,
        model_run_config: Optional[RoundPipeRunConfig] = None,
        pin_model: str = "alloc",
        devices: Optional[str] = None,
        model_memory_limit: Optional[float] = None,
        verbose: bool = False,
        process_group=None,
        shard_optimizer_state: bool = False,
        reduce_dtype: Optional[torch.dtype] = None,
        *,
        host_checkpoint_limit: Optional[float] = None,
        _layers=None,
    ):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoundPipe wraps a torch.nn.Module, got {type(model).__name__}")
        if pin_model not in ("alloc", "register", "off"):
            raise ValueError(f"pin_model must be 'alloc', 'register' or 'off', got {pin_model!r}")
        model_run_config = RoundPipeRunConfig() if model_run_config is None else model_run_config
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError("model_run_config must be a RoundPipeRunConfig")
        if _layers is None:
            if isinstance(model, nn.Sequential):
                if len(model) == 0:
                    raise ValueError("RoundPipe needs a non-empty nn.Sequential")
                _layers = [_C.python_layer(child, i == 0) for i, child in enumerate(model)]
            else:
                _layers = [_C.python_layer(model, True)]
        group = distributed.resolve_group(process_group)
        engine_group = None
        if group is not None:
            distributed.check_same_weights(model.named_parameters(), group, type(model).__name__)
            engine_group = distributed.engine_group(group)
        _claim_parameters(self, model)  # before the engine: a refusal leaves nothing behind
        # Plain attributes (not submodules): the original's parameters are the
        # engine's home tensors and must not be registered twice.
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_model_run_config", model_run_config)
        object.__setattr__(self, "_optim_dtype", optim_dtype)
        object.__setattr__(self, "_process_group", group)
        object.__setattr__(self, "_shard_optimizer_state", bool(shard_optimizer_state) and group is not None)
        # Data parallel runs in the engine (Note [Data parallel steps] and
        # [Sharded optimizer state] in src/runtime/parallel/gradient_averager.h), on
        # a Gloo group of its own.
        object.__setattr__(self, "_engine", _C.Engine(
            _layers, optim_dtype, name or _call_site(), pin_model, devices or "",
            model_memory_limit, bool(verbose or ModelTimer.VERBOSE),
            process_group=engine_group.boxed() if engine_group is not None else None,
            reduce_dtype=reduce_dtype, shard_optimizer_state=bool(shard_optimizer_state),
            host_checkpoint_limit=host_checkpoint_limit))
        object.__setattr__(self, "_names", self._original_names())
        object.__setattr__(self, "training", model.training)
        _live_roundpipes.add(self)

    # ------------------------------------------------------------ calls

    def forward(self, *args, roundpipe_run_config: Optional[RoundPipeRunConfig] = None, **kwargs):
        """Runs the model on CPU inputs and returns the merged outputs (on
        output_device). With grad enabled the outputs are connected to
        autograd: ``loss.backward()`` runs the backward stages."""
        config, value = self._engine_call(roundpipe_run_config, args, kwargs, fused=False)
        training = config.requires_grad if config.requires_grad is not None else torch.is_grad_enabled()
        if training and not torch.is_grad_enabled():
            raise RuntimeError(
                f"{self.name}: requires_grad=True in the run config while autograd is off "
                "(torch.no_grad() or inference mode): the outputs could not join a graph. Call it with "
                "grad enabled, or leave requires_grad unset")
        if training and config.merge_output is not None and not config.pack_output:
            # A custom merge (a function or spec tree) differentiates as it
            # is: the microbatch outputs come back each connected to
            # autograd, and the merge runs here, recorded by autograd.
            merge, config.merge_output, config.pack_output = config.merge_output, None, True
            out = self._engine.forward(value, config)
            return merge([self._user_microbatch_output(o) for o in out])
        out = self._engine.forward(value, config)
        return self._user_output(out, config)

    def forward_backward(
        self,
        input_args=(),
        input_kwargs=None,
        label=None,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        return_outputs: bool = False,
        run_config: Optional[RoundPipeRunConfig] = None,
    ):
        """Fused training call: per microbatch forward, ``loss_fn(output,
        label)`` on the device, backward. Returns the sum of the microbatch
        losses (CPU), or ``(loss, merged outputs)``. Returns once the losses
        are known; backward stages go on in the background."""
        if not isinstance(input_args, tuple):
            input_args = (input_args,)
        input_kwargs = {} if input_kwargs is None else dict(input_kwargs)
        user_loss = _default_loss_fn if loss_fn is None else loss_fn
        config, value = self._engine_call(run_config, input_args, input_kwargs, fused=True,
                                          whole_batch_loss=loss_fn is None)
        # The default loss_fn returns the model's loss: where the model's
        # layers promise that it adds up over rows (the presets'), the
        # engine may run a microbatch's tail in chunks of rows. A caller's
        # loss_fn may run on chunks too, checked (Note [A caller's loss over
        # row chunks]).
        config.loss_sums_over_rows = loss_fn is None
        to_user = self._user_microbatch_output
        # A loss_fn may return a sequence of losses (as the original's): the
        # backward is through their sum, and the call returns each one's
        # sum over the microbatches.
        parts, parts_lock = [], threading.Lock()

        def microbatch_loss(output, lbl):
            loss = user_loss(to_user(output), lbl)
            if isinstance(loss, (list, tuple)):
                if not loss or not all(isinstance(t, torch.Tensor) and t.numel() == 1 for t in loss):
                    raise TypeError("loss_fn returned a sequence: it must hold single-element loss tensors")
                # (Not in the calls for a chunk's gradient only: Note [A caller's
                # loss over row chunks].)
                if _C.loss_value_is_reported():
                    values = torch.stack([t.detach().reshape(()).float() for t in loss]).cpu()
                    with parts_lock:
                        parts.append(values)
                return functools.reduce(lambda a, b: a + b, [t.reshape(()) for t in loss])
            return loss

        loss, out = self._engine.forward_backward(value, label, microbatch_loss, return_outputs, config)
        if parts:
            loss = list(torch.stack(parts).sum(0).unbind())
        if return_outputs:
            return loss, self._user_output(out, config)
        return loss

    # ------------------------------------------------------------ optimizer

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args, **kwargs) -> None:
        """Queues an optimizer step on the optimizer thread: the gradients
        since the last step are added into the masters' ``.grad``, then
        ``step_fn()`` runs (typically ``opt.step(); opt.zero_grad()``), then
        the weights are published layer by layer. Async: the next iteration
        runs on weights one update old; sync: returns after publishing.

        ``step(optimizer)`` is ``step(lambda: (optimizer.step(),
        optimizer.zero_grad()))``; with a ``roundpipe.optim.Adam`` (or
        ``AdamW``) built on ``optim_parameters()``, the same numbers, fused: the low-
        precision gradients are read and the new weights written in Adam's
        own pass over memory, without a float32 ``.grad`` or a copy of the
        masters into the weights (Note [A fused step from Python])."""
        from .optim import Adam

        if isinstance(step_fn, torch.optim.Optimizer):
            if args or kwargs:
                raise TypeError("step(optimizer) takes no further arguments")
            if isinstance(step_fn, Adam) and step_fn._can_fuse():
                self._engine.step_update(in_step_function(step_fn._fused_update), bool(is_async))
                return
            optimizer = step_fn  # another optimizer: what the lambda does
            step_fn = lambda: (optimizer.step(), optimizer.zero_grad())  # noqa: E731
        if not callable(step_fn):
            raise TypeError("step() takes a function that steps the optimizer, e.g. lambda: (opt.step(), opt.zero_grad())")
        if args or kwargs:  # the original's step(step_fn, is_async, *args, **kwargs)
            step_fn = functools.partial(step_fn, *args, **kwargs)
        self._engine.step(in_step_function(step_fn), bool(is_async))

    def synchronize(self) -> None:
        """Finishes pending steps and transfers, publishes the latest master
        weights into the model and adds gradients no step consumed into the
        parameters' ``.grad``. Call before evaluating or saving."""
        self._engine.synchronize()

    def _close_at_exit(self) -> None:
        """At interpreter exit, after synchronize(): drops the engine (its
        threads joined on the package's reaper) while the interpreter still
        runs; later use raises."""
        object.__setattr__(self, "_engine", _ClosedEngine(self._engine.name))
        _live_roundpipes.discard(self)

    def pipeline_stats(self) -> dict:
        """What the pipeline spent and did so far: the optimizer's updates and
        their seconds, waits for weights and for earlier calls, and how many
        fused-tail microbatches ran in chunks of rows (the engine's answer to
        a short memory budget where the model's loss adds up over rows)."""
        return dict(self._engine.pipeline_stats())

    def host_memory_stats(self) -> dict:
        """The host memory this RoundPipe holds in its arena (pin_model="alloc":
        the weights, the fused step's staging copies, downloads), in bytes:
        reserved, pinned, allocated and its peak, and the model's own weights
        (model_state_bytes)."""
        return dict(self._engine.host_memory_stats())

    def optim_parameters(self):
        """An iterator over the optimizer's master copies (optim_dtype) of the
        trainable parameters, created on first use (as the original, an
        iterator, like nn.Module.parameters()); tied parameters appear once.
        With shard_optimizer_state, this process's share of them."""
        return iter(self._optim_list())

    def optim_named_parameters(self, prefix: str = "", remove_duplicate: bool = True):
        """An iterator over (name, master) pairs, named as in the original
        model (``prefix`` first). A tied parameter has one master: listed
        once, under its first name, or (remove_duplicate=False) under each
        of its names."""
        return iter(self._optim_named_list(prefix, remove_duplicate))

    def _optim_list(self) -> list:
        return list(self._engine.optim_parameters())

    def _optim_named_list(self, prefix: str = "", remove_duplicate: bool = True) -> list:
        dot = prefix + "." if prefix else ""
        pairs = [(self._names.get(n, n), p) for n, p in self._engine.optim_named_parameters()]
        if remove_duplicate:
            return [(dot + n, p) for n, p in pairs]
        aliases = {}  # first name -> every name of that parameter
        by_id = {}
        for n, p in self._model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), n)
            aliases.setdefault(by_id[id(p)], []).append(n)
        return [(dot + alias, p) for n, p in pairs for alias in aliases.get(n, [n])]

    # ------------------------------------------------------------ module API

    def parameters(self, recurse: bool = True):
        if _in_optimizer_ctx():
            return self.optim_parameters()
        _warn_model_parameters()
        return self._model.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        if _in_optimizer_ctx():
            return self.optim_named_parameters(prefix)
        _warn_model_parameters()
        return self._model.named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True):
        return self._model.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._model.named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The original model's state dict after synchronize()."""
        self.synchronize()
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError("RoundPipe keeps its parameter tensors; load_state_dict(assign=True) would replace them")
        self.synchronize()
        return self._model.load_state_dict(state_dict, strict)

    def train(self, mode: bool = True):
        self._model.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def to(self, *args, **kwargs):
        raise RuntimeError("a RoundPipe model stays in CPU memory (the engine moves layers to the GPUs); "
                           "convert dtype before wrapping, e.g. RoundPipe(model.to(torch.float16))")

    cuda = to

    @property
    def name(self) -> str:
        return self._engine.name

    @property
    def num_layers(self) -> int:
        return self._engine.num_layers

    @property
    def devices(self) -> list:
        return list(self._engine.devices)

    @property
    def model_run_config(self) -> RoundPipeRunConfig:
        return self._model_run_config

    @property
    def model(self) -> nn.Module:
        """The wrapped model."""
        return self._model

    @property
    def original_model(self) -> nn.Module:
        """Where attributes the wrapper lacks are read from: the model
        set_original_model() named (a preset's HuggingFace model), else the
        wrapped model."""
        return self.__dict__.get("_original") or self._model

    def set_original_model(self, model: nn.Module) -> None:
        """Makes `model` the target of attribute reads, writes and deletes
        (with the wrapped model), as the original's presets do."""
        object.__setattr__(self, "_original", model)

    @property
    def optim_dtype(self):
        return self._optim_dtype

    @property
    def layers(self) -> list:
        """The scheduled layers: the Sequential's children, or the model."""
        return list(self._model) if isinstance(self._model, nn.Sequential) else [self._model]

    @property
    def layer_size(self) -> list:
        """Each scheduled layer's parameter and buffer bytes, in GB (the
        original's attribute); a tensor shared by layers counts in each."""
        return [sum(t.numel() * t.element_size() for t in
                    {id(t): t for t in list(layer.parameters()) + list(layer.buffers())}.values()) / 1e9
                for layer in self.layers]

    @property
    def model_timer(self):
        """The original's ModelTimer of this model. The engine measures and
        smooths the layer times itself (``verbose=True`` or
        ``ModelTimer.VERBOSE`` logs them with the plan); this object carries
        the original's class attributes."""
        from .timer import ModelTimer

        return ModelTimer()

    def __getitem__(self, index):
        return self._model[index]

    def __len__(self):
        return len(self._model)


    def __repr__(self):
        return f"RoundPipe({self._engine.name}, {self.num_layers} layers on {', '.join(self.devices)})"

    # ------------------------------------------------------------ hooks for presets

    # Static, so that the functions the engine keeps (loss, split) never hold
    # the RoundPipe itself.
    @staticmethod
    def _engine_input(args: tuple, kwargs: dict):
        return (args, kwargs)

    @staticmethod
    def _user_microbatch_output(output):
        return output

    def _call_extras(self, args: tuple, kwargs: dict, view, fused: bool) -> dict:
        """Keyword arguments added to every microbatch of a call, computed
        from the whole batch (view: the resolved run config; fused: a
        forward_backward call, whose losses the engine sums, rather than
        forward, whose 0-dim outputs it averages)."""
        return {}

    def _user_output(self, out, config):
        if config.pack_output:
            return _pack_leaves([self._user_microbatch_output(o) for o in out])
        return self._user_microbatch_output(out)

    # ------------------------------------------------------------ internals

    def _original_names(self) -> dict:
        by_id = {}
        for n, p in self._model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), n)
        return {n: by_id.get(id(p), n) for n, p in self._engine.named_parameters()}

    def _engine_call(self, call_config, args, kwargs, fused, whole_batch_loss=False):
        """The engine's input value and the call's run config resolved
        against the model's, with split and merge functions adapted to the
        engine's one value per call. whole_batch_loss: forward_backward with
        the default loss_fn (Note [Microbatch losses] in wrap.py)."""
        if call_config is not None and not isinstance(call_config, RoundPipeRunConfig):
            raise TypeError("roundpipe_run_config / run_config must be a RoundPipeRunConfig")
        model = self._model_run_config
        view = types.SimpleNamespace(**{f: _resolve(call_config, model, f) for f in (
            "requires_grad", "output_device", "preserve_rng_state", "recompute_grain",
            "num_microbatch", "execute_plan")})
        split_input = _resolve(call_config, model, "split_input")
        packed = _packed_microbatches(args, kwargs)
        view.packed_input = packed is not None
        view.whole_batch_loss = whole_batch_loss
        view.split_input = None
        if packed is not None:
            view.num_microbatch = len(packed)
            value = tuple(self._engine_input(tuple(a), dict(k)) for a, k in packed)
        merge = _resolve(call_config, model, "merge_output")
        view.pack_output = merge is False
        automatic = merge is None or merge is False or merge is True
        view.merge_output = None if automatic else _specs.merge_output_function(merge)
        split_label = _resolve(call_config, model, "split_label")
        view.split_label = None if split_label is None else _specs.split_label_function(split_label)
        if split_input is not None:
            split_input = _specs.split_input_function(split_input)
        if packed is None:
            extras = self._call_extras(args, kwargs, view, fused)
            value = self._engine_input(args, {**kwargs, **extras})
            if split_input is not None:
                def split(value, n, f=split_input):
                    parts = f(args, kwargs, n)
                    return [self._engine_input(tuple(a), {**dict(k), **extras}) for a, k in parts]
                view.split_input = split
        return view, value

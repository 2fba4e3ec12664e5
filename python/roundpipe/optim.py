"""roundpipe.optim.Adam: the C++ CPU Adam/AdamW kernel as a torch optimizer."""
from __future__ import annotations

import threading
import warnings

import torch

from . import _C

# model.step(optimizer)'s gradients while its update runs, per thread and
# optimizer (each RoundPipe steps on a thread of its own).
_fused_batches = threading.local()


class Adam(torch.optim.Optimizer):
    """Adam (AdamW with ``decoupled_weight_decay=True``) for CPU tensors: one
    vectorised, multithreaded pass over all parameters of a group, outside
    the GIL. Follows ``torch.optim.Adam`` operation by operation (fp32:
    equal to 1e-6). State and ``state_dict()`` are torch.optim's, so LR
    schedulers and checkpoints work as usual."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False):
        # The original's signature: one multithreaded CPU kernel whatever
        # foreach/fused say (a warning, as there), no CUDA graphs, no
        # differentiable step (an error, as there).
        if foreach is not None or fused is not None:
            warnings.warn("roundpipe.optim.Adam always runs its fused multithreaded CPU kernel; "
                          "foreach and fused are ignored", UserWarning, stacklevel=2)
        if capturable:
            raise AssertionError("roundpipe.optim.Adam runs on the CPU: capturable=True (CUDA graphs) "
                                 "is not supported")
        if differentiable:
            raise AssertionError("roundpipe.optim.Adam: differentiable=True is not supported")
        lr = float(lr.item()) if isinstance(lr, torch.Tensor) else lr
        betas = tuple(float(b.item()) if isinstance(b, torch.Tensor) else b for b in betas)
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused = getattr(_fused_batches, "by_optimizer", {}).get(id(self))  # (_fused_update)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, outs = [], [], [], [], [], [], []
            absmaxes, sq_absmaxes = [], []
            for p in group["params"]:
                grad, out = p.grad, None
                if fused is not None:
                    low, out = fused.pop(p._cdata, (None, None))
                    if low is not None:
                        if grad is None:
                            # Read as it is (its float32 value, exactly), where the
                            # kernel can write `out` in its pass; else as float32.
                            dense = out.is_contiguous() and low.is_contiguous() and low.dtype == out.dtype
                            grad = low if dense else low.float()
                        else:
                            _add_into(grad, low)  # a .grad left from before, as in a step function
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("roundpipe.optim.Adam does not support sparse gradients")
                if p.device.type != "cpu":
                    raise RuntimeError(f"roundpipe.optim.Adam updates CPU tensors; got one on {p.device} "
                                       "(build it on RoundPipe.optim_parameters())")
                state = self.state[p]
                if not state:
                    self._init_state(p, group, state)
                state["step"] += 1
                m, v, vmax, m_absmax, v_absmax = self._moments(state)
                params.append(p)
                grads.append(grad)
                exp_avgs.append(m)
                exp_avg_sqs.append(v)
                max_sqs.append(vmax)
                absmaxes.append(m_absmax)
                sq_absmaxes.append(v_absmax)
                steps.append(int(state["step"]))
                outs.append(out)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            quantized = any(a is not None for a in absmaxes)
            _C.adam_update(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, float(group["lr"]),
                           float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                           bool(group["amsgrad"]), bool(group["maximize"]),
                           bool(group["decoupled_weight_decay"]), outs if fused is not None else None,
                           absmaxes if quantized else None, sq_absmaxes if quantized else None)
        return loss

    def _init_state(self, p, group, state):
        """A new parameter's state, as torch.optim.Adam makes it."""
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    def _moments(self, state):
        """(exp_avg, exp_avg_sq, max_exp_avg_sq, and for 8-bit moments
        their absmax tensors) of a parameter's state, as the kernel reads them."""
        return state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq"), None, None

    # Note [A fused step from Python]
    # The original's idiom, model.step(lambda: (optimizer.step(),
    # optimizer.zero_grad())), makes the optimizer thread cast each call's
    # float16 gradients into float32 .grad tensors, run this Adam over them,
    # and later copy every master into its float16 weight: three passes over
    # memory where the C++ fused step (RoundPipe::step(adam)) makes one,
    # reading the float16 gradient and writing the float16 weight beside
    # the master's update. model.step(optimizer) asks for that pass here (an
    # opt-in: a step function may do anything, this only what the lambda
    # does). The engine hands _fused_update the masters, their float16
    # gradients and where each new weight goes (the staging copy that
    # publishing swaps in, or with a sync step the weight itself); step()
    # then reads those gradients as they are (their float32 values exactly,
    # which is what the cast into .grad held) and _C.adam_update writes the
    # outputs in the same pass. Hyperparameters come from the param groups
    # when the update runs, as in the step function. On 2 CPU cores with 268M
    # parameters the optimizer's work per step fell from 0.26-0.29 s to
    # 0.18 s (bench/README.md, "A fused step from Python").
    def _fused_update(self, masters, grads, outs):
        """``model.step(optimizer)``'s update, on the optimizer thread:
        ``step()`` then ``zero_grad()`` (LR schedulers see a step as usual),
        where each master's gradient is the low-precision one of the calls,
        read in the same pass over memory that writes the new weight into
        its ``outs`` entry, never cast into ``.grad`` (only taken where
        nothing else reads it: _can_fuse). The numbers are those of ``model.step(lambda:
        (optimizer.step(), optimizer.zero_grad()))``. A master not in this
        optimizer's groups keeps its gradient in ``.grad`` and its weight,
        as a step function would leave them."""
        # (If this raises, the engine publishes each master as it is.)
        batch = {m._cdata: (g, o) for m, g, o in zip(masters, grads, outs)}
        if not hasattr(_fused_batches, "by_optimizer"):
            _fused_batches.by_optimizer = {}
        _fused_batches.by_optimizer[id(self)] = batch
        try:
            self.step()
        finally:
            del _fused_batches.by_optimizer[id(self)]
        with torch.no_grad():
            for m, g, o in zip(masters, grads, outs):
                if m._cdata in batch:  # not stepped here
                    if m.grad is None:
                        m.grad = g.to(m.dtype)
                    else:
                        _add_into(m.grad, g)
                    o.copy_(m)
        self.zero_grad()

    def _can_fuse(self) -> bool:
        """Whether model.step(self) may take the fused pass: nothing but
        this class's own step() reads the gradients, so none needs them in
        .grad (no step hooks, no subclass step, no GradScaler.unscale_ asked
        for outside a step function). Otherwise it runs as the lambda."""
        from .grad_scaler import _unscales_asked_outside

        import torch.optim.optimizer as hooks

        return (_unwrapped(type(self).step) is _ADAM_STEP and not self._optimizer_step_pre_hooks
                and not self._optimizer_step_post_hooks
                and not getattr(hooks, "_global_optimizer_pre_hooks", None)
                and not getattr(hooks, "_global_optimizer_post_hooks", None)
                and all(optimizer is not self for _, optimizer in _unscales_asked_outside))


def _add_into(grad, g):
    """grad += g as a step function's gradients are added to a .grad left
    from before: in place where that is exact, else through g's cast."""
    if torch.promote_types(grad.dtype, g.dtype) == grad.dtype:
        grad.add_(g)
    else:
        grad.add_(g.to(grad.dtype))


def _unwrapped(function):
    """`function` without its decorators (no_grad, torch's profiling hook)."""
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function


_ADAM_STEP = _unwrapped(Adam.step)


class AdamW(Adam):
    """Adam with decoupled weight decay (default weight_decay 0.01, as torch)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True)


class Adam8bit(Adam):
    """bitsandbytes' ``Adam8bit`` on the CPU: both moments of every parameter
    of at least ``min_8bit_size`` elements stored in its blockwise 8-bit
    format (one byte a value, one float32 scale a block of 256, dynamic
    quantization maps), 2 bytes a parameter instead of 8; smaller parameters
    keep float32 moments. The update is bitsandbytes' (weight decay, as
    there, is decoupled), in the same vectorised pass as :class:`Adam`, and
    ``model.step(optimizer)`` fuses it the same way. The state is
    bitsandbytes' too (``state1``/``state2`` codes, ``absmax1``/``absmax2``,
    ``qmap1``/``qmap2``, ``step``), so its ``state_dict()`` loads into a
    bitsandbytes optimizer and back."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        # bitsandbytes' signature: optim_bits stays at its default (the state
        # is 8-bit whatever it says), args is its global override mechanism
        # and is_paged its GPU paging (no meaning on the CPU).
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support amsgrad=True (as in bitsandbytes)")
        if optim_bits != 32:
            raise ValueError(f"{type(self).__name__} keeps 8-bit state; leave optim_bits at its default")
        if args is not None:
            raise ValueError(f"{type(self).__name__}: bitsandbytes' args override is not supported; "
                             "pass the hyperparameters as arguments")
        if min_8bit_size < 0:
            raise ValueError(f"Invalid min_8bit_size: {min_8bit_size}")
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True)
        self.min_8bit_size = int(min_8bit_size)

    def _init_state(self, p, group, state):
        state["step"] = 0
        if p.numel() >= self.min_8bit_size:
            blocks = (p.numel() + 255) // 256
            state["state1"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
            state["qmap1"] = _C.dynamic_map(signed=True)
            state["state2"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
            state["qmap2"] = _C.dynamic_map(signed=False)
            state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        else:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _moments(self, state):
        return state["state1"], state["state2"], None, state.get("absmax1"), state.get("absmax2")

    # bitsandbytes' state_dict() nests these under one key (its FSDP
    # compatibility), and its load_state_dict() takes either form.
    _QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"
    _QUANT_STATE = ("state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2")

    def state_dict(self):
        """As bitsandbytes' state_dict(): torch's, the quantization state of each
        parameter nested under ``"__bnb_optimizer_quant_state__"``."""
        state_dict = super().state_dict()
        nested = {}
        for key, param_state in state_dict["state"].items():
            param_state = dict(param_state)
            quant = {k: param_state.pop(k) for k in self._QUANT_STATE if k in param_state}
            if quant:
                param_state[self._QUANT_STATE_KEY] = quant
            nested[key] = param_state
        state_dict["state"] = nested
        return state_dict

    def load_state_dict(self, state_dict):
        """As torch's (either state_dict form), except that the 8-bit scales and
        maps stay float32 (torch casts floating state to the parameter's dtype)
        and float32 moments of small parameters too, as bitsandbytes keeps them."""
        flat = {}
        for key, param_state in state_dict["state"].items():
            param_state = dict(param_state)
            param_state.update(param_state.pop(self._QUANT_STATE_KEY, {}))
            flat[key] = param_state
        state_dict = {**state_dict, "state": flat}
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            for key in self._QUANT_STATE:
                if key in saved and torch.is_tensor(saved[key]):
                    self.state[p][key] = saved[key].to(device=p.device, copy=True)
            self.state[p]["step"] = int(saved["step"])


class AdamW8bit(Adam8bit):
    """bitsandbytes' ``AdamW8bit``: :class:`Adam8bit` with weight decay 0.01
    by default."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, optim_bits=32, args=None, min_8bit_size=4096, is_paged=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size,
                         is_paged)

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
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                params.append(p)
                grads.append(grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                max_sqs.append(state.get("max_exp_avg_sq"))
                steps.append(int(state["step"].item()))
                outs.append(out)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            _C.adam_update(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, float(group["lr"]),
                           float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                           bool(group["amsgrad"]), bool(group["maximize"]),
                           bool(group["decoupled_weight_decay"]), outs if fused is not None else None)
        return loss

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

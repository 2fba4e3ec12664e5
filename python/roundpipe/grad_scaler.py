"""Dynamic loss scaling for RoundPipe's asynchronous optimizer thread."""
from __future__ import annotations

import warnings

import torch

from . import _C


# unscale_() calls made outside a step function: run at the start of the next
# one, where the gradients have reached the optimizers (the original runs
# them on its optimizer thread, in order with the steps).
_unscales_asked_outside = []


def run_unscales_asked_outside() -> None:
    while _unscales_asked_outside:
        scaler, optimizer = _unscales_asked_outside.pop(0)
        scaler._impl.unscale(scaler._grads(optimizer))


class GradScaler:
    """Loss scaling for fp16 training with an asynchronous optimizer::

        loss_fn:  return scaler.scale(loss)          # device workers
        step_fn:  scaler.step(opt); opt.zero_grad()  # optimizer thread
        loop:     model.step(step_fn); scaler.update()

    Iteration k scales by the scale after k updates and step k unscales by
    that same value; an overflow in step k changes the scale from iteration
    k + 2 (one iteration of lag, the same in sync and async mode)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        self._impl = _C.GradScaler(float(init_scale), float(growth_factor), float(backoff_factor),
                                   int(growth_interval), bool(enabled))
        self._warned_outside = False

    def scale(self, outputs):
        """The loss (or each of an iterable of losses) times the current
        scale; the same when disabled."""
        if isinstance(outputs, torch.Tensor):
            return self._impl.scale(outputs)
        scaled = [self.scale(o) for o in outputs]
        return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else scaled

    @staticmethod
    def _grads(optimizer):
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscales the optimizer's gradients, for example before clipping
        them; the step's ``step()`` does not unscale them again. At most once
        per step. Inside the step function: now. From the main thread (the
        original queues it on the optimizer thread and waits): the gradients
        reach the optimizer only inside the next step function, so they are
        unscaled there, before anything else the step function does; to
        inspect or clip them, do it in the step function."""
        from .roundpipe import inside_step_function

        if inside_step_function():
            self._impl.unscale(self._grads(optimizer))
            return
        if not self._warned_outside:
            self._warned_outside = True
            warnings.warn(
                "GradScaler.unscale_() outside the step function: the gradients are unscaled on "
                "the optimizer thread at the start of the next step function (they reach the "
                "optimizer only there), so clipping or reading them here sees none; do that in the "
                "step function: def step_fn(): scaler.unscale_(opt); clip_grad_norm_(...); "
                "scaler.step(opt)", stacklevel=2)
        _unscales_asked_outside.append((self, optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscales the optimizer's gradients (unless ``unscale_`` did), and
        runs ``optimizer.step(*args, **kwargs)`` unless one holds inf/NaN.
        Returns what ``optimizer.step`` returned, or None when skipped."""
        result = []
        self._impl.step(self._grads(optimizer), lambda: result.append(optimizer.step(*args, **kwargs)))
        return result[0] if result else None

    def update(self, new_scale=None, is_async: bool = True) -> None:
        """Advances the scale after a RoundPipe step. Async (the default):
        from the finding of the step before the latest one (one step of lag,
        so the trajectory does not depend on timing). ``is_async=False``:
        from the latest step's, waiting for it (pair it with
        ``step(..., is_async=False)``). ``new_scale`` (a float or a
        one-element tensor) replaces the scale: async, from the next
        ``update()`` on, as in the original (this one advances it as
        usual); not async, at once."""
        if new_scale is not None:
            new_scale = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
        self._impl.update(new_scale, bool(is_async))

    def get_scale(self) -> float:
        return self._impl.get_scale()

    def is_enabled(self) -> bool:
        return self._impl.is_enabled()

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        return self._impl.get_growth_factor()

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        return self._impl.get_backoff_factor()

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        return self._impl.get_growth_interval()

    def set_growth_factor(self, new_factor: float) -> None:
        self._impl.set_growth_factor(float(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        self._impl.set_backoff_factor(float(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        self._impl.set_growth_interval(int(new_interval))

    def found_inf(self, step: int) -> bool:
        """Whether scaler.step number `step` (from 0) found inf/NaN."""
        return self._impl.found_inf(step)

    def state_dict(self) -> dict:
        return dict(self._impl.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self._impl.load_state_dict({k: float(v) for k, v in state.items()})

"""Dynamic loss scaling for RoundPipe's asynchronous optimizer thread."""
from __future__ import annotations

import torch

from . import _C


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

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self._impl.scale(loss)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscales the optimizer's gradients, and steps it unless one holds
        inf/NaN. Returns whether it stepped."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return self._impl.step(grads, optimizer.step)

    def update(self) -> None:
        self._impl.update()

    def get_scale(self) -> float:
        return self._impl.get_scale()

    def found_inf(self, step: int) -> bool:
        """Whether scaler.step number `step` (from 0) found inf/NaN."""
        return self._impl.found_inf(step)

    def state_dict(self) -> dict:
        return dict(self._impl.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self._impl.load_state_dict({k: float(v) for k, v in state.items()})

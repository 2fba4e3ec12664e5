"""Helpers for layers whose forward does random or host-syncing work that a
recompute must not redo (MoE routing counts, nonzero(), .item())."""
from __future__ import annotations

from . import _C


def save_for_recompute(*data) -> None:
    """Keeps `data` (no tensor in it may require grad) for this layer and
    microbatch, once per layer per microbatch. A no-op outside RoundPipe,
    in a recompute, or in an inference call (without gradients no
    recompute follows)."""
    _C.save_for_recompute(tuple(data))


def doing_recompute() -> bool:
    """Whether the current layer call is a recompute in a backward stage."""
    return _C.doing_recompute()


class NotInRecomputeError(RuntimeError, AssertionError):
    """get_recompute_data() outside a recompute. A RuntimeError, and an
    AssertionError as the original raises there."""


def get_recompute_data() -> tuple:
    """In a recompute: what the forward saved (a tuple), on this device,
    or None where the forward saved nothing. Elsewhere NotInRecomputeError."""
    if not _C.doing_recompute():
        raise NotInRecomputeError("get_recompute_data() is only valid during a recompute "
                                  "(check doing_recompute() first)")
    return _C.get_recompute_data()

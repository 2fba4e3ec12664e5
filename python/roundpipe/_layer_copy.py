"""Structural copies of layers for the device workers."""
import copy

import torch
from torch import nn

# Set on a forward that AutoRoundPipe installed on a module: the module's
# copies run the class's own forward.
DISPATCH_MARK = "_roundpipe_dispatch"


def structural_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters and buffers are empty
    placeholders of the same dtype (no weight memory is copied): the engine
    binds device tensors into them for each job."""
    memo = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty(0, dtype=b.dtype)
    try:
        result = copy.deepcopy(module, memo)
    except Exception as e:  # noqa: BLE001 - re-raised with the fix
        raise TypeError(
            f"RoundPipe runs copies of each layer on the devices, but {type(module).__name__} "
            f"cannot be deep-copied ({type(e).__name__}: {e}). Keep non-copyable objects "
            "(locks, open files, generators) out of layer modules."
        ) from e
    for m in result.modules():
        forward = m.__dict__.get("forward")
        if forward is not None and getattr(forward, DISPATCH_MARK, False):
            del m.__dict__["forward"]
    return result


_OWN_STATE = ("_parameters", "_buffers", "_modules")


def refresh(copy_: nn.Module, original: nn.Module) -> None:
    """Points the copy's plain attributes (flags, train/eval mode, hooks,
    non-buffer tensors) at the original's current ones; its parameters,
    buffers and submodules stay its own."""
    for c, o in zip(copy_.modules(), original.modules()):
        own = c.__dict__
        for key, value in o.__dict__.items():
            if key in _OWN_STATE or (key == "forward" and getattr(value, DISPATCH_MARK, False)):
                continue
            own[key] = value

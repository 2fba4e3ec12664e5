"""RoundPipe: fine-tune models bigger than your GPUs.

All model state lives in CPU memory, GPUs are a stateless pool, pipeline
stages are dispatched to them round-robin, activations are recomputed, and
the optimizer runs on the CPU while the GPUs already work on the next step.
The engine is C++ (on LibTorch); this package is its Python face.
"""
import atexit
import sys

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C, optim, timer
from .errors import StageError
from .grad_scaler import GradScaler
from .recompute import doing_recompute, get_recompute_data, save_for_recompute
from .roundpipe import OptimizerCtx, PackedMicrobatches, RoundPipe, _live_roundpipes
from .run_config import ModelExecutePlan, RoundPipeRunConfig
from .trainer import TrainingArguments, TrainResult, train
from .wrap import AutoRoundPipe, CausalLMRoundPipe, wrap_model_to_roundpipe

__version__ = "0.1.0"


def _finish_at_exit():
    """A script may end with work in flight (backward stages, an async
    step): it finishes while the interpreter still runs, since the engine's
    threads need it for Python layers, losses and step functions. An error
    found now has nobody left to catch it: it is printed, and the exit
    status stays what Python gives. See Note [Engine lifetime in Python]
    in python/src/module.cpp."""
    pipes = list(_live_roundpipes)
    for pipe in pipes:
        try:
            pipe.synchronize()
        except BaseException as error:  # noqa: BLE001 (nobody is left to catch it)
            print(f"roundpipe: {pipe.name}: pending work failed at exit: "
                  f"{type(error).__name__}: {error}", file=sys.stderr)
    # Then their engines go, threads joined, while the interpreter still
    # runs: no thread of ours is left when C++ destroys its statics at exit
    # (a thread that outlived them ended a CUDA run with "terminate called
    # without an active exception").
    for pipe in pipes:
        pipe._close_at_exit()
    del pipes
    _C.shutdown()


atexit.register(_finish_at_exit)

__all__ = [
    "AutoRoundPipe", "CausalLMRoundPipe", "GradScaler", "ModelExecutePlan", "OptimizerCtx",
    "PackedMicrobatches", "RoundPipe", "RoundPipeRunConfig", "StageError", "TrainResult",
    "TrainingArguments", "doing_recompute", "get_recompute_data", "optim", "save_for_recompute",
    "train", "wrap_model_to_roundpipe",
]

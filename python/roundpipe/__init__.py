"""RoundPipe: fine-tune models bigger than your GPUs.

All model state lives in CPU memory, GPUs are a stateless pool, pipeline
stages are dispatched to them round-robin, activations are recomputed, and
the optimizer runs on the CPU while the GPUs already work on the next step.
The engine is C++ (on LibTorch); this package is its Python face.
"""
import atexit

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C, optim
from .errors import StageError
from .grad_scaler import GradScaler
from .recompute import doing_recompute, get_recompute_data, save_for_recompute
from .roundpipe import OptimizerCtx, PackedMicrobatches, RoundPipe
from .run_config import ModelExecutePlan, RoundPipeRunConfig
from .wrap import AutoRoundPipe, CausalLMRoundPipe, wrap_model_to_roundpipe

__version__ = "0.1.0"

# RoundPipes dropped by Python are destroyed on a thread of their own; let
# them finish (their jobs may run Python layers) before the interpreter goes.
atexit.register(_C.wait_for_released_engines)

__all__ = [
    "AutoRoundPipe", "CausalLMRoundPipe", "GradScaler", "ModelExecutePlan", "OptimizerCtx",
    "PackedMicrobatches", "RoundPipe", "RoundPipeRunConfig", "StageError", "doing_recompute",
    "get_recompute_data", "optim", "save_for_recompute", "wrap_model_to_roundpipe",
]

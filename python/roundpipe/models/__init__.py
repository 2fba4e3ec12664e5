"""roundpipe.models: the presets, keyed as the original keys them, by the
exact class name of the HuggingFace model (``type(model).__name__``); the
values name our native preset (the C++ Qwen3 and Llama layers)."""
from ..wrap import PRESETS

SUPPORTED_MODELS = dict(PRESETS)

__all__ = ["SUPPORTED_MODELS"]

"""roundpipe.batch: where the original keeps RoundPipePackedData, the
per-microbatch outputs of a call with ``merge_output=False``. Here they are
``PackedMicrobatches`` (a list of whole microbatch outputs, see the README's
table of differences); the original's name refers to it."""
from .roundpipe import PackedMicrobatches

RoundPipePackedData = PackedMicrobatches

__all__ = ["RoundPipePackedData"]

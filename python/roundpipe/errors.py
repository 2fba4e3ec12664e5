"""The exception a failure inside the pipeline reaches the caller as."""


class StageError(RuntimeError):
    """A stage job failed on a device worker.

    The message names the RoundPipe, stage, layer, microbatch, phase and
    device, then the original error, which is also this exception's
    ``__cause__`` when it was a Python exception (raised by a layer, the loss
    function or a split/merge function). The RoundPipe stays usable.
    """

    def __init__(self, message, stage, layer, microbatch, phase, device, out_of_memory):
        super().__init__(message)
        self.stage = stage  # e.g. "forward stage 1 (layers 2..3)"
        self.layer = layer  # -1 when not inside a layer
        self.microbatch = microbatch  # -1 when not inside a microbatch
        self.phase = phase  # upload, forward, recompute, backward, loss, download
        self.device = device  # "sim:1", "cuda:0"
        self.out_of_memory = out_of_memory

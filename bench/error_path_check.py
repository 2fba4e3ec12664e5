"""A layer that raises, outside pytest: the error must reach the caller as
StageError with the original exception as its cause (diagnoses crashes on a
machine where the pytest run died)."""
import faulthandler
import sys

import torch
from torch import nn

import roundpipe

if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
    torch._C._set_print_stack_traces_on_fatal_signal(True)  # native stacks of every thread
else:
    faulthandler.enable()


class Fails(nn.Module):
    def forward(self, x):
        raise ValueError("boom")


for devices in ("sim:1", "sim:2"):
    for fused in (False, True):
        pipe = roundpipe.RoundPipe(nn.Sequential(nn.Linear(2, 2), Fails()), devices=devices)
        print(f"{devices} fused={fused}: calling", flush=True)
        try:
            if fused:
                pipe.forward_backward(input_args=(torch.randn(4, 2),), loss_fn=lambda o, t: o.sum())
            else:
                with torch.no_grad():
                    pipe(torch.randn(4, 2))
        except roundpipe.StageError as e:
            print(f"  StageError phase={e.phase} layer={e.layer} cause={e.__cause__!r}", flush=True)
print("python", sys.version)

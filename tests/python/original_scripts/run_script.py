"""Runs one of the original's benchmark scripts as a user would, with only
what the machine forces:

  run_script.py CAP_GIB SCRIPT ARGS...

- CAP_GIB > 0 caps the GPU with torch.cuda.set_per_process_memory_fraction
  before anything touches CUDA (a consumer card of that size).
- Without flash-attn installed, "flash_attention_2" reads "sdpa" (the only
  change made to the script's text).
- to_empty gives zeroed memory, so that runs are deterministic and finite
  (the scripts leave the norms' and LoRA's weights as to_empty made them:
  whatever the memory held, NaN included on a GPU).
- Without a GPU, the script's CUDA calls are pointed at the CPU (to_empty,
  synchronize and empty_cache); the engine runs on its simulated device.
- LOSSES=FILE (environment) writes the loss of every forward_backward call,
  one per line, for the tests. On a GPU it prints the allocator's peak
  reserved memory at exit (a MEMORY line)."""
import atexit
import importlib.util
import os
import sys

import torch

cap_gib, script, args = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
if torch.cuda.is_available() and cap_gib > 0:
    total = torch.cuda.get_device_properties(0).total_memory  # allocates nothing
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, 0)

source = open(script).read()
if importlib.util.find_spec("flash_attn") is None:
    source = source.replace('"flash_attention_2"', '"sdpa"')

to_empty = torch.nn.Module.to_empty


def to_empty_zeroed(self, *, device, recurse=True):
    if not torch.cuda.is_available() and str(device).startswith("cuda"):
        device = "cpu"
    to_empty(self, device=device, recurse=recurse)
    with torch.no_grad():
        for t in list(self.parameters(recurse)) + list(self.buffers(recurse)):
            t.zero_()
    return self


torch.nn.Module.to_empty = to_empty_zeroed
if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None

if os.environ.get("LOSSES"):
    import roundpipe
    losses = []
    forward_backward = roundpipe.RoundPipe.forward_backward

    def recorded(self, *a, **k):
        loss = forward_backward(self, *a, **k)
        losses.append(float(sum(loss) if isinstance(loss, (list, tuple)) else loss))
        return loss

    roundpipe.RoundPipe.forward_backward = recorded
    atexit.register(lambda: open(os.environ["LOSSES"], "w").write("".join(f"{x}\n" for x in losses)))

if torch.cuda.is_available():  # for the benchmark's table: what the allocator held at its peak
    def report_memory():
        stats = torch.cuda.memory_stats()
        print(f"MEMORY peak_reserved={stats.get('reserved_bytes.all.peak', 0) / 2**30:.2f} GiB "
              f"peak_alloc={stats.get('allocated_bytes.all.peak', 0) / 2**30:.2f} GiB "
              f"ooms={stats.get('num_ooms', 0)}", flush=True)
    atexit.register(report_memory)

sys.argv = [script] + args
exec(compile(source, script, "exec"), {"__name__": "__main__", "__file__": script})

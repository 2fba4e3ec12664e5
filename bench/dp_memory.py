"""Host memory per process of data parallel training with and without
shard_optimizer_state (issue 21), on loopback with Gloo: N processes, each a
RoundPipe over simulated devices (or the GPU: DEVICES=cuda) around a stack
of LAYERS Linear(WIDTH, WIDTH) layers in bf16 with float32 masters and
roundpipe.optim.Adam, two steps on its shard of a batch. Prints, per
process, the anonymous resident memory (smaps_rollup) and its parts: the
weights, the masters, the optimizer's moments, the masters' gradients left
after the step.

  python3 bench/dp_memory.py N SHARDED [LAYERS WIDTH]
"""
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lora_bench import host_memory

GIB = 2**30


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def worker(rank, world, init, sharded, layers, width, out):
    import roundpipe
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    start = host_memory()[0]
    pipe = roundpipe.RoundPipe(model, optim_dtype=torch.float32, devices=os.environ.get("DEVICES", "sim:1"),
                               shard_optimizer_state=sharded)
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-4)
    x = torch.randn(8 * world, width, dtype=torch.bfloat16)
    rows = slice(rank * 8, (rank + 1) * 8)
    for _ in range(2):
        pipe.forward_backward(input_args=(x[rows],), loss_fn=lambda out, _: out.float().pow(2).mean())
        pipe.step(lambda: (opt.step(), opt.zero_grad(set_to_none=False)), is_async=False)
    pipe.synchronize()
    masters = [m for _, m in pipe._engine.optim_named_parameters()]
    moments = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    line = (f"rank {rank}/{world} {'sharded' if sharded else 'replicated'}: anonymous "
            f"{host_memory()[0] - start:.2f} GiB over the model's start; weights "
            f"{tensor_bytes(model.parameters()) / GIB:.2f}, masters {tensor_bytes(masters) / GIB:.2f}, "
            f"moments {tensor_bytes(moments) / GIB:.2f}, masters' gradients "
            f"{tensor_bytes([m.grad for m in masters]) / GIB:.2f} GiB; peak RSS {host_memory()[3]:.2f} GiB")
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    world, sharded = int(sys.argv[1]), sys.argv[2] not in ("0", "false")
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    width = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), sharded, layers, width, tmp), nprocs=world)
        for r in range(world):
            print(open(os.path.join(tmp, f"rank{r}.txt")).read(), end="")

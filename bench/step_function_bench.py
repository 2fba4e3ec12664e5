"""The host side of a step with the caller's step function, the original's
idiom (`model.step(lambda: (optim.step(), optim.zero_grad()))`, torch's
zero_grad setting .grad to None), on simulated devices: no GPU needed.
Times the optimizer thread's update per step (pipeline_stats()
optimizer_update_seconds: the gradients cast into the float32 masters'
.grad, then roundpipe.optim.Adam's pass) for a stack of LAYERS x
Linear(WIDTH, WIDTH) in float16 with float32 masters, one row a call so that
the devices' compute is negligible. Run it under two versions of the package
(PYTHONPATH picks) for a before/after on one machine:

  step_function_bench.py [LAYERS [WIDTH [STEPS [fused]]]]   (default 16 4096 6)

With `fused`, the step is model.step(optim) (Note [A fused step from
Python]) instead of the step function.

Prints: RESULT params=... update_s_per_step=... publish_s_per_step=... (the
means of the steps after the first two; publishing copies the float32 masters
into the float16 weights: optimizer_publish_seconds).
"""
import sys
import time

import torch

import roundpipe

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 16
width = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
fused = len(sys.argv) > 4 and sys.argv[4] == "fused"
torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).half()
model = roundpipe.RoundPipe(net, optim_dtype=torch.float32,
                            model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=1))
optim = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-5)
x = torch.randn(1, width).half()
per_step, publish = [], []
for step in range(steps):
    before = model.pipeline_stats()["optimizer_update_seconds"]
    published = model.pipeline_stats()["optimizer_publish_seconds"]
    model.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.float().square().mean())
    model.step(optim if fused else lambda: (optim.step(), optim.zero_grad()), is_async=False)
    per_step.append(model.pipeline_stats()["optimizer_update_seconds"] - before)
    publish.append(model.pipeline_stats()["optimizer_publish_seconds"] - published)
params = sum(p.numel() for p in net.parameters())
timed, timed_publish = per_step[2:] or per_step, publish[2:] or publish
print(f"  update seconds per step: {', '.join(f'{s:.3f}' for s in per_step)}")
print(f"  publish seconds per step: {', '.join(f'{s:.3f}' for s in publish)}")
print(f"RESULT step={'fused' if fused else 'function'} params={params} update_s_per_step={sum(timed) / len(timed):.3f} "
      f"publish_s_per_step={sum(timed_publish) / len(timed_publish):.3f}")

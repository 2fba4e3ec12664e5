"""How to compute a LoRA projection (issue 18: fuse the adapters' matmuls with
the base projection where that is faster). One Qwen3-8B decoder layer's seven
projections on a microbatch of 2 x 4096 tokens, bf16 base weights (frozen),
rank 16 adapters, forward and backward (input and adapter gradients), timed
with CUDA events. Variants:

  base       the base projections alone (no adapters): the floor
  fp32       the adapters in float32 as peft keeps them (input cast to
             float32, float32 matmuls): what the presets do today
  fp32-tf32  the same with TF32 matmuls allowed
  bf16       the adapters' factors cast to bf16 on the device, the adapter
             path in bf16 (fp32 accumulation)
  cat        bf16, and the first factor's matmul fused into the base one:
             one matmul with [W; A] (the concatenation made every call)

  lora_matmul_bench.py [TOKENS]
"""
import sys

import torch

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
hidden, inter, kv, rank, scale = 4096, 12288, 1024, 16, 2.0
shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
          (hidden, inter), (hidden, inter), (inter, hidden)]  # q k v o gate up down
dev = "cuda"
torch.manual_seed(0)
weights = [torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02 for i, o in shapes]
adapters = [(torch.randn(rank, i, device=dev) * 0.02, torch.randn(o, rank, device=dev) * 0.02)
            for i, o in shapes]
for a, b in adapters:
    a.requires_grad_(True)
    b.requires_grad_(True)
inputs = {i: torch.randn(tokens, i, device=dev, dtype=torch.bfloat16, requires_grad=True)
          for i in (hidden, inter)}


def projection(variant, x, w, a, b):
    if variant == "base":
        return torch.nn.functional.linear(x, w)
    if variant.startswith("fp32"):
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x.float(), a), b) * scale
        return torch.nn.functional.linear(x, w) + delta.to(x.dtype)
    a16, b16 = a.to(x.dtype), b.to(x.dtype)
    if variant == "bf16":
        return torch.nn.functional.linear(x, w) + torch.nn.functional.linear(
            torch.nn.functional.linear(x, a16), b16) * scale
    both = torch.nn.functional.linear(x, torch.cat([w, a16]))  # cat: [W; A]
    y, xa = both.split([w.shape[0], a16.shape[0]], dim=-1)
    return torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, rank), b16.t(), alpha=scale)


def layer(variant):
    total = 0
    for (i, _), w, (a, b) in zip(shapes, weights, adapters):
        total = total + projection(variant, inputs[i], w, a, b).float().mean()
    total.backward()


results = {}
for variant in ("base", "fp32", "fp32-tf32", "bf16", "cat"):
    torch.backends.cuda.matmul.allow_tf32 = variant == "fp32-tf32"
    for _ in range(3):
        layer(variant)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        layer(variant)
    end.record()
    torch.cuda.synchronize()
    results[variant] = start.elapsed_time(end) / 20
torch.backends.cuda.matmul.allow_tf32 = False
base = results["base"]
print(f"one Qwen3-8B layer's projections, {tokens} tokens, rank {rank}, forward + backward (ms):")
for variant, ms in results.items():
    print(f"  {variant:10s} {ms:7.3f} ms  ({ms / base:.3f} x base, adapters {100 * (ms - base) / base:+.1f}%)")

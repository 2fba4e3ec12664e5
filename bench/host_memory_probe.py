"""Issue 33, item 4: where does host memory grow in bfloat16 with varying
sequence lengths? On a CPU with AVX-512, LibTorch runs bfloat16 matmuls
through oneDNN, which keeps a compiled primitive per shape; on an AVX2-only
CPU (the build machine) it does not, and nothing grows there.

  host_memory_probe.py PART STEPS
    PART: linear (a bf16 linear's forward and backward, the rows varying),
          sdpa (causal attention, the length varying),
          engine (a tiny Qwen3 in bfloat16 through roundpipe on two simulated
          devices, packed rows of varying length, Adam steps)

Prints `RSS step=N mib=M` lines and one `GROWTH` line: resident memory at the
end minus at step STEPS // 10 (after the first allocations settle)."""
import os
import random
import sys

import torch

part, steps = sys.argv[1], int(sys.argv[2])


def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


print(f"cpu: mkldnn bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()} "
      f"ONEDNN_PRIMITIVE_CACHE_CAPACITY={os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY')} "
      f"LRU_CACHE_CAPACITY={os.environ.get('LRU_CACHE_CAPACITY')}", flush=True)
rng = random.Random(0)
if part == "engine":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
    import roundpipe
    from hf_models import tiny_qwen3
    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

    model = tiny_qwen3().to(torch.bfloat16)
    pipe = wrap_model_to_roundpipe(model, devices="sim:2", optim_dtype=torch.float32,
                                   use_sequential_preset=True,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    optim = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-4)

    def one_step():
        ids = torch.randint(0, 96, (4, rng.randint(8, 128)))
        pipe.forward_backward(input_kwargs={"input_ids": ids, "labels": ids,
                                            "attention_mask": torch.ones_like(ids)})
        pipe.step(lambda: (optim.step(), optim.zero_grad(), None)[-1])
elif part == "linear":
    w = torch.randn(384, 128, dtype=torch.bfloat16, requires_grad=True)

    def one_step():
        x = torch.randn(8 * rng.randint(8, 512), 128, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.linear(x, w).float().sum().backward()
elif part == "sdpa":
    def one_step():
        length = rng.randint(8, 512)
        q, k, v = (torch.randn(4, 4, length, 32, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
else:
    sys.exit(f"unknown part {part}")

import time  # noqa: E402

settled = None
began = time.perf_counter()
for step in range(1, steps + 1):
    one_step()
    if step == max(1, steps // 10):
        settled = rss_mib()
    if step % max(1, steps // 10) == 0:
        print(f"RSS step={step} mib={rss_mib():.0f}", flush=True)
print(f"GROWTH part={part} mib={rss_mib() - settled:.0f} settled={settled:.0f} "
      f"ms_per_step={1000 * (time.perf_counter() - began) / steps:.1f}", flush=True)

"""Where a full fine-tune's host memory goes, byte by byte, on a simulated
device: a random Qwen3 shape in bfloat16 with float32 masters and moments,
roundpipe.optim.Adam, two training calls a step of rows short enough that
activations are negligible. Prints the resident set (anonymous memory, the
part the kernel's OOM killer counts) after the model is made, after the
wrap, and after each step, as bytes per trainable parameter above the made
model, and the tensors the engine and the optimizer hold, by kind.

  host_memory_breakdown.py [--idiom step_fn|fused] [--steps N] [--layers L]
                           [--hidden H] [--optim adam|adamw|another class of roundpipe.optim]
"""
import argparse
import ctypes
import gc
import os
import sys

import torch


def anon_bytes():
    """RssAnon + RssShmem of this process (file-backed pages excluded: the
    libraries' code, which the kernel may drop)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_free_bytes():
    """Bytes glibc's heaps hold free (kept from the system, counted resident
    where touched)."""
    return _libc.mallinfo2().fordblks


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--idiom", default="step_fn", choices=["step_fn", "fused"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--optim", default="adam")
    ap.add_argument("--device", default="sim:1,mem=640MiB")
    args = ap.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    import roundpipe
    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

    torch.manual_seed(0)
    h = args.hidden
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=h, intermediate_size=3 * h,
                         num_hidden_layers=args.layers, num_attention_heads=h // 128,
                         num_key_value_heads=max(1, h // 256), head_dim=128,
                         tie_word_embeddings=False, dtype=torch.bfloat16)
    base = anon_bytes()
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    gc.collect()
    params = sum(p.numel() for p in model.parameters())
    made = anon_bytes()
    print(f"params {params / 1e6:.1f} M; model made: {(made - base) / params:.2f} B/param", flush=True)

    pipe = wrap_model_to_roundpipe(model, devices=args.device, optim_dtype=torch.float32,
                                   use_sequential_preset=True,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    del model
    gc.collect()
    print(f"wrapped: {(anon_bytes() - made) / params:+.2f} B/param above the made model", flush=True)
    cls = {"adam": roundpipe.optim.Adam, "adamw": roundpipe.optim.AdamW}.get(args.optim)
    if cls is None:
        cls = getattr(roundpipe.optim, args.optim)
    optim = cls(pipe.optim_parameters(), lr=1e-4)
    print(f"masters made: {(anon_bytes() - made) / params:+.2f} B/param", flush=True)
    rows = torch.randint(0, args.vocab, (2, 64))
    losses = []
    for step in range(args.steps):
        for _ in range(2):
            losses.append(pipe.forward_backward(
                input_kwargs={"input_ids": rows, "labels": rows,
                              "attention_mask": torch.ones_like(rows)},
                loss_fn=lambda o, _: o.loss / 2).item())
        if args.idiom == "step_fn":
            pipe.step(lambda: (optim.step(), optim.zero_grad(), None)[-1])
        else:
            pipe.step(optim)
        print(f"step {step + 1}: {(anon_bytes() - made) / params:+.2f} B/param above the made model; "
              f"peak {(peak_rss_bytes() - made) / params:+.2f}", flush=True)
    pipe.synchronize()
    stats = pipe.host_memory_stats() if hasattr(pipe, "host_memory_stats") else None
    print(f"synchronized: {(anon_bytes() - made) / params:+.2f} B/param; peak "
          f"{(peak_rss_bytes() - made) / params:+.2f}; arena {stats}", flush=True)
    state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    masters = sum(p.numel() * p.element_size() for p in pipe.optim_parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in pipe.optim_parameters()
                if p.grad is not None)
    print(f"optimizer state {state / params:.2f} B/param, masters {masters / params:.2f}, "
          f".grad {grads / params:.2f}", flush=True)
    free = heap_free_bytes()
    before = anon_bytes()
    _libc.malloc_trim(0)
    print(f"glibc heaps hold {free / params:.2f} B/param free; malloc_trim returns "
          f"{(before - anon_bytes()) / params:.2f}", flush=True)
    print("losses " + " ".join(f"{l:.6f}" for l in losses), flush=True)


if __name__ == "__main__":
    sys.exit(main())

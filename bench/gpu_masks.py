"""Padded and packed batches on CUDA, two checks per batch:
  1. semantics: the preset in float32 (per-sequence attention) against
     transformers in float32 (sdpa with its dense mask) on the same weights
     and inputs: loss, logits (where the mask is 1) and gradients;
  2. the kernel: the preset in bfloat16 through LibTorch's variable-length
     flash attention against the same preset in bfloat16 with flash turned
     off (SDPA sequence by sequence): the two differ only in the attention
     kernel's rounding.
(A bfloat16 preset against bfloat16 transformers is no oracle here: with
random weights the two round in different places, and even unmasked batches
differ by 10-20% in the logits.) Prints errors and the peak device memory of
each run; exits 1 past the tolerances below.
With WINDOW=N in the environment the last two layers attend to the last N
tokens (Qwen3's sliding window: the flash kernel's window against SDPA with
a banded mask, and transformers), and an unpadded batch is checked too.
Usage: gpu_masks.py [total tokens, default 32768]."""
import copy
import os
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
WINDOW = int(os.environ.get("WINDOW", "0"))
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# float32, same semantics: the same products summed in other orders over a
# 4-layer model (1e-5 relative per layer is generous; 1e-4 at the end).
FP32_TOL = 1e-4
# bfloat16 (eps 2^-8 = 3.9e-3) through two attention kernels: a few eps.
BF16_TOL = 3e-2


def model(dtype):
    torch.manual_seed(0)
    sliding = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2) if WINDOW else {}
    config = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=TOKENS, use_cache=False, attn_implementation="sdpa",
                         **sliding)
    return Qwen3ForCausalLM(config).to(dtype).eval()


def batches():
    g = torch.Generator().manual_seed(1)
    half = TOKENS // 2
    ids = torch.randint(0, 32000, (2, half), generator=g)
    mask = torch.ones(2, half, dtype=torch.long)
    mask[0, :half // 4] = 0      # left padding
    mask[1, half - half // 6:] = 0  # right padding
    labels = ids.clone()
    labels[mask == 0] = -100
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
    lengths = [TOKENS // 8 * 3, TOKENS // 32, TOKENS // 4, 77]
    lengths.append(TOKENS - sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    ids = torch.randint(0, 32000, (1, TOKENS), generator=g)
    labels = ids.clone()
    labels[positions == 0] = -100
    packed = dict(input_ids=ids, position_ids=positions, labels=labels)
    cases = {f"padded 2 x {half} (left, right)": (padded, 2),
             f"packed 1 x {TOKENS} (5 documents)": (packed, 1)}
    if WINDOW:
        ids = torch.randint(0, 32000, (2, half), generator=g)
        cases[f"rows 2 x {half}, window {WINDOW}"] = (dict(input_ids=ids, labels=ids.clone()), 2)
    return cases


def rel(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, (torch.cuda.max_memory_allocated() - base) / 2**30


def ours(dtype, inputs, microbatches, flash=True):
    """Loss, logits, gradients and peak GiB of the preset."""
    torch.backends.cuda.enable_flash_sdp(flash)
    m = model(dtype)
    pipe = wrap_model_to_roundpipe(m, devices="cuda", return_logits=False,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=microbatches))

    def step():
        loss = pipe.forward_backward(input_kwargs=inputs)
        pipe.synchronize()
        return loss

    loss, gib = peak(step)
    with torch.no_grad():
        logits = pipe(**{k: v for k, v in inputs.items() if k != "labels"}, return_logits=True,
                      roundpipe_run_config=RoundPipeRunConfig(num_microbatch=microbatches)).logits
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    del pipe
    torch.backends.cuda.enable_flash_sdp(True)
    return loss, logits, grads, gib


def transformers_fp32(inputs):
    oracle = model(torch.float32).cuda()
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}

    def step():
        out = oracle(**cuda_inputs)
        out.loss.backward()
        return out.loss.detach()

    loss, gib = peak(step)
    with torch.no_grad():
        logits = oracle(**{k: v for k, v in cuda_inputs.items() if k != "labels"}).logits
    grads = {n: p.grad for n, p in oracle.named_parameters()}
    return loss, logits, grads, gib


def compare(a, b, keep):
    loss = abs(a[0].item() - b[0].item()) / abs(b[0].item())
    logits = rel(a[1].float().cpu()[keep], b[1].float().cpu()[keep])
    grads = max(rel(a[2][n], b[2][n]) for n in b[2])
    return loss, logits, grads


def report(what, ours_run, reference, keep, tol, peaks):
    """Prints one comparison; whether it is within `tol`."""
    errors = compare(ours_run, reference, keep)
    ok = max(errors) <= tol
    print(f"{what}: loss rel {errors[0]:.1e}, logits rel {errors[1]:.1e}, worst gradient rel "
          f"{errors[2]:.1e}; peak GiB {peaks} {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def main():
    failed = False
    for name, (inputs, microbatches) in batches().items():
        keep = (inputs["attention_mask"].bool() if "attention_mask" in inputs
                else torch.ones_like(inputs["input_ids"], dtype=torch.bool))
        hf = transformers_fp32(inputs)
        fp32 = ours(torch.float32, inputs, microbatches)
        failed |= not report(f"{name}, float32 vs transformers", fp32, hf, keep, FP32_TOL,
                             f"ours {fp32[3]:.2f}, transformers {hf[3]:.2f} (with its [T, T] mask)")
        del hf, fp32
        flash = ours(torch.bfloat16, inputs, microbatches, flash=True)
        exact = ours(torch.bfloat16, inputs, microbatches, flash=False)
        failed |= not report(f"{name}, bfloat16 varlen flash vs per-sequence SDPA", flash, exact, keep,
                             BF16_TOL, f"flash {flash[3]:.2f}, per-sequence {exact[3]:.2f}")
        torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""Padded and packed 32K-token batches on CUDA: the preset (variable-length
flash attention, no [T, T] mask) against transformers (sdpa, which builds
the mask) on the same bf16 weights and inputs. Prints loss, logits and
gradient errors and the peak device memory of each; exits 1 past the bf16
tolerances below. Usage: gpu_masks.py [total tokens, default 32768]."""
import copy
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import roundpipe
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
# bf16 keeps 8 bits (eps 2^-8 = 3.9e-3); two attention kernels and 4 layers
# of bf16 rounding apart: relative errors of a few eps.
LOSS_TOL, LOGITS_TOL, GRAD_TOL = 1e-2, 5e-2, 5e-2


def model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=TOKENS, use_cache=False, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).to(torch.bfloat16).eval()


def batches():
    g = torch.Generator().manual_seed(1)
    half = TOKENS // 2
    ids = torch.randint(0, 32000, (2, half), generator=g)
    mask = torch.ones(2, half, dtype=torch.long)
    mask[0, :half // 4] = 0      # left padding
    mask[1, half - 3000:] = 0    # right padding
    labels = ids.clone()
    labels[mask == 0] = -100
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
    lengths = [TOKENS // 8 * 3, 1000, TOKENS // 4, 77]
    lengths.append(TOKENS - sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    ids = torch.randint(0, 32000, (1, TOKENS), generator=g)
    labels = ids.clone()
    labels[positions == 0] = -100
    packed = dict(input_ids=ids, position_ids=positions, labels=labels)
    return {"padded 2 x %d (left, right)" % half: (padded, 2), "packed 1 x %d (5 documents)" % TOKENS: (packed, 1)}


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


def main():
    failed = False
    for name, (inputs, microbatches) in batches().items():
        ours_model = model()
        oracle = copy.deepcopy(ours_model).cuda()
        pipe = wrap_model_to_roundpipe(ours_model, devices="cuda", return_logits=False,
                                       model_run_config=RoundPipeRunConfig(num_microbatch=microbatches))

        def ours_step():
            loss = pipe.forward_backward(input_kwargs=inputs)
            pipe.synchronize()
            return loss

        loss, ours_gib = peak(ours_step)
        cuda_inputs = {k: v.cuda() for k, v in inputs.items()}

        def hf_step():
            out = oracle(**cuda_inputs)
            out.loss.backward()
            return out.loss.detach()

        expected, hf_gib = peak(hf_step)
        with torch.no_grad():
            logits = pipe(**{k: v for k, v in inputs.items() if k != "labels"}, return_logits=True,
                          roundpipe_run_config=RoundPipeRunConfig(num_microbatch=microbatches)).logits
            ref = oracle(**{k: v for k, v in cuda_inputs.items() if k != "labels"}).logits
        keep = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones_like(inputs["input_ids"], dtype=torch.bool)
        logits_err = rel(logits[keep], ref.cpu()[keep])
        ours_grads = dict(ours_model.named_parameters())
        grad_err = max(rel(ours_grads[n].grad, p.grad) for n, p in oracle.named_parameters())
        loss_err = abs(loss.item() - expected.item()) / abs(expected.item())
        ok = loss_err <= LOSS_TOL and logits_err <= LOGITS_TOL and grad_err <= GRAD_TOL
        failed |= not ok
        print(f"{name}: loss {loss.item():.5f} vs transformers {expected.item():.5f} (rel {loss_err:.1e}), "
              f"logits rel {logits_err:.1e}, worst gradient rel {grad_err:.1e}; peak GiB: ours {ours_gib:.2f} "
              f"(stage work on the device), transformers {hf_gib:.2f} (incl. its [T, T] mask) "
              f"{'OK' if ok else 'FAIL'}", flush=True)
        del pipe, oracle
        torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

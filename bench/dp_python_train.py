"""Data parallel through the Python package on the GPU machine (issue 21).
Run under torchrun: each process wraps a HuggingFace Qwen3 checkpoint (the
preset; bf16 weights, fp32 masters, roundpipe.optim.Adam, 4 microbatches)
and trains on its share of every batch of padded rows with an
attention_mask, as a tokenizer gives them (random lengths from half to all
of SEQ, right padding, labels -100 on the padding), its device capped by
DEVICES (default: a 24 GiB card). Rank 0 prints each step's seconds and
loss and the means after the first step; every process prints its peak
host memory.

  torchrun --nproc-per-node N bench/dp_python_train.py MODEL STEPS SHARDED [BATCH SEQ]
"""
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import transformers

import roundpipe

path, steps, sharded = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
batch, seq = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (16, 4096)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, use_cache=False)
pipe = roundpipe.wrap_model_to_roundpipe(
    model, optim_dtype=torch.float32, shard_optimizer_state=sharded,
    devices=os.environ.get("DEVICES", "cuda,mem=24GiB"),
    model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=4))
opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-5)
g = torch.Generator().manual_seed(0)  # every rank draws the same batches
share = batch // world
rows = slice(rank * share, (rank + 1) * share)
seconds, tokens, losses = [], [], []
last = time.perf_counter()
for step in range(steps):
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    loss = pipe.forward_backward(input_kwargs=dict(input_ids=ids[rows], attention_mask=mask[rows],
                                                   labels=labels[rows]))
    pipe.step(lambda: (opt.step(), opt.zero_grad()))
    now = time.perf_counter()
    seconds.append(now - last)
    last = now
    tokens.append(int(lengths.sum()))
    losses.append(float(loss.sum()) if torch.is_tensor(loss) else float(sum(loss)))
    if rank == 0:
        print(f"step {step + 1}: {seconds[-1]:.2f} s, {tokens[-1]} tokens, loss (rank 0's share) {losses[-1]:.4f}",
              flush=True)
pipe.synchronize()
if rank == 0:
    s = sum(seconds[1:]) / len(seconds[1:])
    print(f"{world} process(es){', sharded' if sharded else ''}: {s:.2f} s/step, "
          f"{sum(tokens[1:]) / sum(seconds[1:]):,.0f} tokens/s (all processes, unpadded)", flush=True)
dist.barrier()
print(f"rank {rank}: peak host resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB, "
      f"masters kept {sum(p.numel() for p in pipe.optim_parameters()):,}", flush=True)
dist.destroy_process_group()

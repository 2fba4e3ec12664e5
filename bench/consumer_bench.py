"""Training as a user with a consumer card would: the Python API with default
settings (wrap_model_to_roundpipe on a HuggingFace model, fp16 weights, fp32
masters, async roundpipe.optim.Adam, 4 microbatches, no grain or limit
chosen), on a GPU capped with torch.cuda.set_per_process_memory_fraction to
stand in for a smaller card, with the tokenizer's attention_mask. One
configuration per process (the cap must come before any CUDA allocation).
Prints one line: tokens/s, the plan's predicted peak and the measured peak.

  consumer_bench.py SHAPE CAP_GIB BATCH SEQ MASK [STEPS]
  consumer_bench.py --write-train-data DIR ROWS SEQ   (the 1.7B config.json and
      ROWS rows of SEQ random tokens, data.jsonl, for roundpipe-train)
    SHAPE: 1.7B | 4B | llama3-3B;  CAP_GIB: 0 = no cap
    MASK: ones (every tokenizer's output) | padded (a quarter of each row
          left-padded) | none
  SQUEEZE_GIB=G (environment): before the fourth step, take G GiB of the
  card for something else (as another program would), so that the plan in
  use runs out of memory on CUDA and the engine has to recover.
"""
import os
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import roundpipe
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

SHAPES = {
    "1.7B": (Qwen3Config, Qwen3ForCausalLM,
             dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "4B": (Qwen3Config, Qwen3ForCausalLM,
           dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "tiny": (Qwen3Config, Qwen3ForCausalLM,
             dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "llama3-3B": (LlamaConfig, LlamaForCausalLM,
                  dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                       num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
}

if sys.argv[1] == "--write-train-data":  # for roundpipe-train: DIR ROWS SEQ
    import json
    import os
    out_dir, rows, seq = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    config_cls, _, fields = SHAPES["1.7B"]
    config_cls(**fields, max_position_embeddings=seq, use_cache=False).save_pretrained(out_dir)
    gen = torch.Generator().manual_seed(1)
    with open(os.path.join(out_dir, "data.jsonl"), "w") as f:
        for _ in range(rows):
            ids = torch.randint(0, fields["vocab_size"], (seq,), generator=gen).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")
    sys.exit(0)
shape, cap_gib = sys.argv[1], float(sys.argv[2])
batch, seq, mask_kind = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
steps = int(sys.argv[6]) if len(sys.argv) > 6 else 6
microbatches = min(4, batch)  # (a batch of one sequence is one microbatch)
cuda = torch.cuda.is_available()  # (without: a dry run of this script on simulated devices)
total = torch.cuda.get_device_properties(0).total_memory if cuda else 0
if cap_gib > 0 and cuda:
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, 0)

config_cls, model_cls, fields = SHAPES[shape]
config = config_cls(**fields, max_position_embeddings=max(seq, 4096), use_cache=False)
torch.manual_seed(0)
made = time.perf_counter()
# Random weights, fast: the modules made without their initialisers (on the
# meta device), then every parameter drawn N(0, 0.02) in float32 and stored
# in float16 (transformers' own init of a 4B model takes minutes on a CPU).
with torch.device("meta"):
    model = model_cls(config)
model = model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.empty(p.shape).normal_(0, 0.02) if p.dim() > 1 else torch.ones(p.shape))
model = model.half().eval()
model.tie_weights()
print(f"  model made in {time.perf_counter() - made:.1f} s", flush=True)
pipe = wrap_model_to_roundpipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=microbatches),
                               optim_dtype=torch.float32)
optimizer = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-5)

gen = torch.Generator().manual_seed(1)
ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
inputs = {"input_ids": ids, "labels": ids.clone()}
if mask_kind != "none":
    mask = torch.ones(batch, seq, dtype=torch.long)
    if mask_kind == "padded":
        mask[:, : seq // 4] = 0
        inputs["labels"][mask == 0] = -100
    inputs["attention_mask"] = mask

name = f"{shape} cap {cap_gib:g} GiB, {batch} x {seq} tokens, mask {mask_kind}"
try:
    times = []
    squeeze = float(os.environ.get("SQUEEZE_GIB", "0"))
    for step in range(steps):
        if step == 3 and squeeze > 0 and cuda:
            pipe.synchronize()  # (the pipeline idle: what it holds is the allocator's cache)
            blocker = torch.empty(int(squeeze * 2**30), dtype=torch.uint8, device="cuda")
            print(f"  squeezed: {squeeze:g} GiB taken before step 4", flush=True)
        start = time.perf_counter()
        loss = pipe.forward_backward(input_kwargs=inputs)
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        times.append(time.perf_counter() - start)
        print(f"  step {step + 1}: {times[-1]:.2f} s, loss {float(loss):.4f}, peak "
              f"{torch.cuda.max_memory_allocated() / 2**30 if cuda else 0:.2f} GiB", flush=True)
    pipe.synchronize()
except torch.OutOfMemoryError as e:
    print(f"{name}: OUT OF MEMORY: {str(e).splitlines()[0]}", flush=True)
    sys.exit(2)
# The second half of the steps: the first ones run on the byte-cost plan
# and measure the layers, the next replans on the measurements.
first = len(times) // 2
steady = times[first:]
rate = batch * seq * len(steady) / sum(steady)
# (The plan of the calls: the default loss adds up over rows, so the tail
# may split a microbatch's rows.)
plan, described = pipe._engine.auto_plan(True, microbatches, 0, None, batch // microbatches)
predicted = [line for line in described.splitlines() if "peak" in line.lower() or "GiB" in line]
print(f"{name}: {rate:,.0f} tokens/s (steps {first + 1}..{steps}), loss {float(loss):.4f}, "
      f"measured peak {torch.cuda.max_memory_allocated() / 2**30 if cuda else 0:.2f} GiB allocated / "
      f"{torch.cuda.max_memory_reserved() / 2**30 if cuda else 0:.2f} GiB reserved, budget "
      f"{cap_gib if cap_gib > 0 else total / 2**30:.1f} GiB; plan {plan}; "
      f"{pipe.pipeline_stats()['tail_microbatches_in_row_chunks']} microbatches in row chunks",
      flush=True)
print("  predicted: " + described.replace("\n", "\n  "), flush=True)

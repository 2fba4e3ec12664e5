"""The seed document's wrapping code on a HuggingFace checkpoint, then
training through the Python API (random token ids, async step with
roundpipe.optim.Adam on fp32 masters). Prints a progress line per step and a
summary in the format of roundpipe-train.

  python_seed_train.py CHECKPOINT_DIR [steps] [batch] [seq_len]
"""
import importlib.util
import sys
import time

import torch

path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 16
seq_len = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"

start = time.perf_counter()
# --- the seed's code block (model path replaced) ---
from transformers import AutoModelForCausalLM
from roundpipe import wrap_model_to_roundpipe, RoundPipeRunConfig

model = AutoModelForCausalLM.from_pretrained(
    path,
    use_cache=False,
    dtype=torch.float16,
    _attn_implementation=attn,
)

model = wrap_model_to_roundpipe(
    model,
    use_sequential_preset=True,
    model_run_config=RoundPipeRunConfig(num_microbatch=4),
    optim_dtype=torch.float32,
)
# --- end of the seed's code ---
import roundpipe

optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-5)
params = sum(p.numel() for p in model.parameters())
print(f"python seed example: {type(model.original_model).__name__}, {params / 1e6:.1f}M parameters "
      f"(float16), fp32 masters, {model.num_layers} layers on {', '.join(model.devices)}, "
      f"attention '{attn}' for loading, wrapped in {time.perf_counter() - start:.1f}s", flush=True)

gen = torch.Generator().manual_seed(1)
data = [torch.randint(0, model.vocab_size, (batch, seq_len), generator=gen) for _ in range(4)]
tokens_per_step = batch * seq_len
t0 = time.perf_counter()
last, last_step, steady_start = t0, 0, None
for step in range(1, steps + 1):
    ids = data[step % len(data)]
    loss = model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    now = time.perf_counter()
    if step == 2:
        steady_start = (now, step)
    rate = tokens_per_step * (step - last_step) / (now - last)
    print(f"step {step}/{steps}  loss {float(loss) / 4:.4f}  {rate:.0f} tokens/s  elapsed {now - t0:.1f}s", flush=True)
    last, last_step = now, step
model.synchronize()
end = time.perf_counter()
print(f"summary: {steps} steps, {steps * tokens_per_step} tokens in {end - t0:.1f}s = "
      f"{steps * tokens_per_step / (end - t0):.0f} tokens/s")
if steady_start and steps > 2:
    s_time, s_step = steady_start
    print(f"steady state (steps {s_step + 1}..{steps}, to the last step's synchronize): "
          f"{(steps - s_step) * tokens_per_step / (end - s_time):.0f} tokens/s")

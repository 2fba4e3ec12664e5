"""The no-offload reference for roundpipe-bench: the same random-weight
Qwen3 shape trained GPU-resident with HuggingFace transformers + PyTorch
(per-layer gradient checkpointing, fused AdamW on the GPU, the same batch
and microbatches by gradient accumulation). Prints tokens/s.

  hf_resident_train.py [shape] [batch] [seq] [microbatches] [steps] [dtype]
"""
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "1.7B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "4B": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}

shape = sys.argv[1] if len(sys.argv) > 1 else "tiny"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 4
seq = int(sys.argv[3]) if len(sys.argv) > 3 else 128
microbatches = int(sys.argv[4]) if len(sys.argv) > 4 else 2
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
dtype = getattr(torch, sys.argv[6] if len(sys.argv) > 6 else "bfloat16")
device = "cuda" if torch.cuda.is_available() else "cpu"

config = Qwen3Config(max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa",
                     **SHAPES[shape])
torch.manual_seed(0)
with torch.device(device):
    model = Qwen3ForCausalLM(config).to(dtype)
model.gradient_checkpointing_enable()
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)


def step():
    for chunk in ids.chunk(microbatches):
        model(input_ids=chunk, labels=chunk).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


for _ in range(2):  # warm-up
    step()
if device == "cuda":
    torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(steps):
    step()
if device == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
print(f"hf resident ({shape}, {dtype}, {device}, batch {batch} x {seq}, {microbatches} microbatches): "
      f"{batch * seq * steps / seconds:.0f} tokens/s, peak {peak:.1f} GiB")

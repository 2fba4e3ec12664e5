"""Creates a random-weight HuggingFace Qwen3 checkpoint of a published shape
and a JSONL file of random token ids, for GPU runs of roundpipe-train.

  make_qwen3_checkpoint.py OUT_DIR DATA.jsonl [shape] [sequences] [seq_len]
"""
import json
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}

out, data = sys.argv[1], sys.argv[2]
shape = sys.argv[3] if len(sys.argv) > 3 else "1.7B"
sequences = int(sys.argv[4]) if len(sys.argv) > 4 else 64
seq_len = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
config = Qwen3Config(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, torch_dtype="bfloat16", **SHAPES[shape])
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
with torch.device(device):
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
gen = torch.Generator().manual_seed(1)
with open(data, "w") as f:
    for _ in range(sequences):
        ids = torch.randint(3, config.vocab_size, (seq_len,), generator=gen).tolist()
        f.write(json.dumps({"input_ids": ids}) + "\n")
print(f"Qwen3-{shape} shape: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters -> {out}")

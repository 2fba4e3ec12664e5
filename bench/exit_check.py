"""A short training process that must exit with status 0: a HuggingFace
preset and a plain Sequential of Python layers, each trained a few async
steps on CUDA (or simulated devices), then, with SYNC=1 (default),
synchronize(); with SYNC=0 the script ends with work in flight. gpu_user.sh
(EXITS=N) and tests/python/test_lifecycle.py run it back to back."""
import os

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe

devices = None if torch.cuda.is_available() else "sim:2"
torch.manual_seed(0)
config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
preset = wrap_model_to_roundpipe(Qwen3ForCausalLM(config).half(), optim_dtype=torch.float32,
                                 model_run_config=RoundPipeRunConfig(num_microbatch=2),
                                 devices=devices)
seq = RoundPipe(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)),
                model_run_config=RoundPipeRunConfig(num_microbatch=2), devices=devices)
optims = [roundpipe.optim.Adam(m.optim_parameters(), lr=1e-3) for m in (preset, seq)]
ids = torch.randint(0, 256, (4, 32))
x = torch.randn(8, 32)
for _ in range(3):
    preset.forward_backward(input_kwargs={"input_ids": ids, "labels": ids,
                                          "attention_mask": torch.ones_like(ids)})
    preset.step(lambda: (optims[0].step(), optims[0].zero_grad()))
    seq.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.square().mean())
    seq.step(lambda: (optims[1].step(), optims[1].zero_grad()))
if os.environ.get("SYNC", "1") == "1":
    preset.synchronize()
    seq.synchronize()
print("done", flush=True)

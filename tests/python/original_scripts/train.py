"""Full fine-tuning throughput, as the original RoundPipe's benchmark/train.py
does it (written here from its documented behaviour, ../shared/ORIGINAL_API.md
"The original's benchmark scripts"; not its file): the script a user who
compares runs first, kept so that it runs on our package unchanged.

  train.py MODEL_PATH BATCH SEQ NUM_MICROBATCH ACCUM_STEPS RECOMPUTE_GRAIN

Random token ids; each call's loss is each microbatch's own mean divided by
NUM_MICROBATCH * ACCUM_STEPS; asynchronous step with the CPU Adam; 5 warm-up
and 10 timed iterations; prints the original's "Thoughput: ..." line (sic)."""
import math
import sys
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.device import device_list
from roundpipe.models.function import ChunkedCompileLinearForCausalLMLoss
from roundpipe.optim import Adam

torch.backends.cuda.matmul.allow_fp16_accumulation = True
transformers.modeling_utils._init_weights = False

if len(sys.argv) != 7:
    sys.exit(f"usage: {sys.argv[0]} MODEL_PATH BATCH SEQ NUM_MICROBATCH ACCUM_STEPS stage|layer")
path = sys.argv[1]
batch, seq, microbatches, accum = (int(a) for a in sys.argv[2:6])
grain = sys.argv[6]
assert grain in ("stage", "layer"), "recompute_grain is 'stage' or 'layer'"

tokenizer = AutoTokenizer.from_pretrained(path)
config = AutoConfig.from_pretrained(path)
config._attn_implementation = "flash_attention_2"
config.use_cache = False
config.dtype = torch.float16

# Made on the meta device, each module materialised on the GPU with its own
# initialiser, then moved to the CPU.
with torch.device("meta"):
    hf_model = AutoModelForCausalLM.from_config(config)
for module in hf_model.modules():
    module.to_empty(device="cuda", recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    module._apply(lambda t: t.to(device="cpu", non_blocking=True), recurse=False)
torch.cuda.synchronize()
torch.cuda.empty_cache()

model = wrap_model_to_roundpipe(
    hf_model, optim_dtype=torch.float32, use_sequential_preset=True,
    model_run_config=RoundPipeRunConfig(num_microbatch=microbatches, recompute_grain=grain))
optim = Adam(model.optim_parameters(), lr=1e-5)

tokens = torch.randint(0, tokenizer.vocab_size, (batch, seq))
pieces = tokens.chunk(accum)
masks = [torch.ones_like(p) for p in pieces]

# Warm the loss kernel up on every device, at each microbatch size the
# calls will see, outside autocast.
for entry in device_list:
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features,
                           model.lm_head.bias is not None, device=entry.device, dtype=torch.float16)
    piece_rows = {math.floor(batch / accum), math.ceil(batch / accum)}
    for rows in {r for p in piece_rows for r in (math.floor(p / microbatches), math.ceil(p / microbatches))}:
        hidden = torch.rand(rows, seq, head.in_features, dtype=torch.float16, device=entry.device,
                            requires_grad=True)
        labels = torch.randint(0, tokenizer.vocab_size, (rows, seq), device=entry.device)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            ChunkedCompileLinearForCausalLMLoss(hidden, head, labels)
    del head


def train_iter():
    for piece, mask in zip(pieces, masks):
        model.forward_backward(
            input_kwargs={"input_ids": piece, "attention_mask": mask, "labels": piece,
                          "return_logits": False},
            loss_fn=lambda outputs, _: outputs.loss / microbatches / accum)
    model.step(lambda: (optim.step(), optim.zero_grad(), None)[-1])


for _ in range(5):
    train_iter()
start = time.perf_counter()
for _ in range(10):
    train_iter()
seconds = time.perf_counter() - start
print(f"Time taken for 10 iterations: {seconds} seconds")
print(f"Thoughput: {10 * tokens.numel() / seconds} tokens/second")

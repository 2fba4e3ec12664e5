"""LoRA throughput, as the original RoundPipe's benchmark/train_lora.py does
it (written here from its documented behaviour, ../shared/ORIGINAL_API.md;
not its file).

  train_lora.py MODEL_PATH PIN(0|1) BATCH SEQ NUM_MICROBATCH ACCUM_STEPS

peft LoRA r=32, alpha 16, on every linear layer, made on the meta device and
moved to the CPU in fp16; PIN=0 wraps with pin_model="off" (the setting for
models bigger than host memory), PIN=1 with the default pinning. The loss is
the model's own loss_function on the logits, divided by the default
microbatch count (devices + 1), as the original's script does."""
import sys
import time

import torch
import transformers
from peft import LoraConfig, LoraModel, TaskType
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.optim import Adam

torch._dynamo.config.recompile_limit = 2
torch.backends.cuda.matmul.allow_fp16_accumulation = True
transformers.modeling_utils._init_weights = False

if len(sys.argv) != 7:
    sys.exit(f"usage: {sys.argv[0]} MODEL_PATH PIN(0|1) BATCH SEQ NUM_MICROBATCH ACCUM_STEPS")
path, pin = sys.argv[1], sys.argv[2] == "1"
batch, seq, microbatches, accum = (int(a) for a in sys.argv[3:7])

tokenizer = AutoTokenizer.from_pretrained(path)
config = AutoConfig.from_pretrained(path)
config._attn_implementation = "flash_attention_2"
config.use_cache = False
config.dtype = torch.float16
with torch.device("meta"):
    hf_model = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=32, lora_alpha=16, target_modules="all-linear", task_type=TaskType.CAUSAL_LM)
    lora_model = LoraModel(hf_model, lora, "default").model
for module in lora_model.modules():
    module.to_empty(device="cuda", recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    module._apply(lambda t: t.to(dtype=torch.float16, device="cpu", non_blocking=pin), recurse=False)
torch.cuda.synchronize()
torch.cuda.empty_cache()

model = wrap_model_to_roundpipe(
    lora_model, optim_dtype=torch.float32, use_sequential_preset=True,
    model_run_config=RoundPipeRunConfig(num_microbatch=microbatches),
    **({} if pin else {"pin_model": "off"}))
optim = Adam(model.optim_parameters(), lr=1e-5)

tokens = torch.randint(0, tokenizer.vocab_size, (batch, seq))
pieces = tokens.chunk(accum)
masks = [torch.ones_like(p) for p in pieces]


def loss_fn(outputs, labels):
    loss = model.loss_function(logits=outputs.logits, labels=labels, vocab_size=model.vocab_size)
    return loss / (torch.cuda.device_count() + 1)


def train_iter():
    for piece, mask in zip(pieces, masks):
        model.forward_backward(input_kwargs={"input_ids": piece, "attention_mask": mask},
                               label=piece, loss_fn=loss_fn)
    model.step(lambda: (optim.step(), optim.zero_grad(), None)[-1])


for _ in range(5):
    train_iter()
start = time.perf_counter()
for _ in range(10):
    train_iter()
seconds = time.perf_counter() - start
print(f"Time taken for 10 iterations: {seconds} seconds")
print(f"Thoughput: {10 * tokens.numel() / seconds} tokens/second")

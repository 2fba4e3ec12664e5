"""The script a user brings: the original RoundPipe's own benchmark idiom
(its benchmark/train.py), run unchanged on whichever `roundpipe` is
importable, ours or the original (PYTHONPATH picks), in the default
environment. One configuration per process, since the memory cap must be
set before anything touches CUDA.

  user_train.py SHAPE CAP_GIB BATCH SEQ [TIMED [WARMUP]]
    SHAPE: 1.7B | 4B | 8B | llama3-3B | llama3-8B | tiny;  CAP_GIB: 0 = no cap
  LORA=16 (environment): peft LoRA of that rank on every linear layer, the
  model inside peft.LoraModel as the original's train_lora.py wraps it.
  LOSS=default: no loss_fn (the default), else `o.loss / num_microbatch`.
  FP16_ACCUM=1: torch.backends.cuda.matmul.allow_fp16_accumulation = True, as
  the original's benchmark/train.py sets it.
  QLORA=nf4|fp4|int8 (with LORA=R): QLoRA as a user loads it: the random
  model (bf16 here) is saved, then read back with transformers'
  from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_quant_type=..., bnb_4bit_use_double_quant=True,
  bnb_4bit_compute_dtype=bfloat16) or load_in_8bit, device_map="cpu"),
  bitsandbytes quantizing it; peft on top as above.
  SHORT_FIRST=N: the first N warm-up calls on an eighth of each sequence
  (short first batches, then the full length).
  STEP=optimizer: model.step(optim), our opt-in fused step (Note [A fused
  step from Python]), instead of the original's step function (ours only).
  OPTIM=Adam8bit (or another class of roundpipe.optim): the optimizer
  instead of roundpipe.optim.Adam (ours only).

What it does, as the original's benchmark/train.py does: caps the device
with torch.cuda.set_per_process_memory_fraction (nothing touched CUDA
before), makes the HuggingFace model on the meta device, materialises it
on the GPU module by module with its own initialisers and moves it to the
CPU, empty_cache(); wrap_model_to_roundpipe(model, optim_dtype=float32,
use_sequential_preset=True, RoundPipeRunConfig(num_microbatch=4)),
roundpipe.optim.Adam(lr=1e-5), fp16 weights; each call forward_backward(
input_kwargs={input_ids, attention_mask (ones, as a tokenizer gives),
labels, return_logits=False}, loss_fn=lambda o, _: o.loss / 4) and an
asynchronous step. Prints one result line:
  RESULT impl=... shape=... cap=... tok_s=... peak_alloc=... peak_reserved=...
         device_used=... alloc_retries=... ooms=... update_s=... losses=...
(device_used: the device-wide use at the peak, cudaMemGetInfo, which the
CUDA context adds to on top of the cap; ours also prints, per timed call,
the optimizer's update_s and publish_s, its grad_wait_s, the workers'
weight_wait_s for published weights (above 0: the step bounds the calls),
new calls' start_wait_s, and call_s, the call's wall time, beside
predicted_call_s, the plan's prediction of it). The engine's own out-of-memory
retries print warnings to stderr, which gpu_user.sh counts.
"""
import math
import os
import sys
import time

process_start = time.perf_counter()

import torch

shape, cap_gib = sys.argv[1], float(sys.argv[2])
batch, seq = int(sys.argv[3]), int(sys.argv[4])
timed = int(sys.argv[5]) if len(sys.argv) > 5 else 4
warmup = int(sys.argv[6]) if len(sys.argv) > 6 else 3
num_microbatch = min(4, batch)
cuda = torch.cuda.is_available()
if cuda and cap_gib > 0:
    # First, before any CUDA allocation (get_device_properties allocates nothing).
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, 0)

if os.environ.get("FP16_ACCUM") == "1":  # the original's benchmark/train.py sets it (the paper's runs)
    torch.backends.cuda.matmul.allow_fp16_accumulation = True

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe  # noqa: E402
from roundpipe.optim import Adam  # noqa: E402

impl = "ours" if hasattr(roundpipe, "_C") else "original"
if os.environ.get("ORACLE") == "1":  # the documented semantics in plain transformers + torch
    impl = "oracle"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import make_config  # noqa: E402

config = make_config(shape, seq)
config._attn_implementation = "sdpa"  # (flash-attn is not installed on the GPU machine)
config.use_cache = False
qlora = os.environ.get("QLORA", "")
model_dtype = torch.bfloat16 if qlora else torch.float16
config.dtype = model_dtype
transformers.modeling_utils._init_weights = False
torch.manual_seed(0)
made = time.perf_counter()
with torch.device("meta"):
    hf_model = AutoModelForCausalLM.from_config(config)
device = "cuda" if cuda else "cpu"
for module in hf_model.modules():
    module.to_empty(device=device, recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:  # (norms have no initialiser: ones, as transformers' own init)
        for p in module.parameters(recurse=False):
            torch.nn.init.ones_(p.data)
    module._apply(lambda t: t.to(device="cpu", non_blocking=True), recurse=False)
hf_model = hf_model.to(model_dtype)
if cuda:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
print(f"  model made in {time.perf_counter() - made:.1f} s", flush=True)
if qlora:  # saved, then loaded as a user loads a checkpoint in 4 or 8 bits
    import shutil
    import tempfile
    if qlora == "int8":
        quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    else:
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=qlora, bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=model_dtype)
    checkpoint = tempfile.mkdtemp(prefix="user_train_")
    hf_model.save_pretrained(checkpoint)
    del hf_model
    made = time.perf_counter()
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quantization,
                                                    device_map="cpu", dtype=model_dtype)
    shutil.rmtree(checkpoint)
    print(f"  {qlora} model loaded in {time.perf_counter() - made:.1f} s", flush=True)

lora_rank = int(os.environ.get("LORA", "0"))
if lora_rank:
    import peft
    lora_config = peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"])
    hf_model = peft.LoraModel(hf_model, lora_config, "default").model



class ResidentOracle:
    """What the original's docs say a call does, GPU-resident: per
    microbatch, loss_fn(output) backpropagated as is (fp16 gradients, added
    up in float32); Adam (lr 1e-5) on float32 masters, copied back to the
    fp16 weights; the step one call behind (call k runs on the weights after
    update k - 2: calls 1 and 2 on the initial weights)."""

    def __init__(self, module):
        # The rotary tables are buffers that to_empty left unset (the presets
        # compute their own from the config): made again here.
        for name, sub in list(module.named_modules()):
            if hasattr(sub, "inv_freq"):
                parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
                setattr(parent, name.rsplit(".", 1)[-1], type(sub)(config=module.config))
        self.module = module.to(device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optim = torch.optim.Adam(self.masters, lr=1e-5)
        self.pending = None

    def forward_backward(self, input_kwargs, loss_fn=None):
        kw = {k: v.to(device) if torch.is_tensor(v) else v for k, v in input_kwargs.items()
              if k != "return_logits"}
        grads = [torch.zeros_like(m) for m in self.masters]
        total = 0.0
        for piece in zip(*(kw[k].chunk(num_microbatch) for k in ("input_ids", "attention_mask", "labels"))):
            out = self.module(input_ids=piece[0], attention_mask=piece[1], labels=piece[2])
            loss = loss_fn(out, None) if loss_fn else out.loss
            loss.backward()
            total += float(loss)
            for g, p in zip(grads, self.params):
                g += p.grad.float()
                p.grad = None
        if self.pending is not None:  # the previous call's update, now
            for m, g in zip(self.masters, self.pending):
                m.grad = g
            self.optim.step()
            self.optim.zero_grad()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        self.pending = grads
        return total

    def step(self, fn):
        pass

    def synchronize(self):
        torch.cuda.synchronize() if cuda else None


wrapped = time.perf_counter()
if impl == "oracle":
    model = ResidentOracle(hf_model)
else:
    model = wrap_model_to_roundpipe(
        hf_model, optim_dtype=torch.float32, use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch))
    optim_class = getattr(roundpipe.optim, os.environ.get("OPTIM", "Adam"))
    optim = optim_class(model.optim_parameters(), lr=1e-5)
# (Setup is not timed in tokens/s, but it is most of a short run's wall time.)
print(f"  wrapped in {time.perf_counter() - wrapped:.1f} s ({time.perf_counter() - process_start:.1f} s"
      " since the process started)", flush=True)

input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(input_ids)
kwargs = {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids,
          "return_logits": False}
default_loss = os.environ.get("LOSS") == "default"
losses = []


# SHORT_FIRST=N: the first N warm-up calls take an eighth of each sequence,
# as a user's first batches may be short; the later calls meet a plan
# measured on them (Note [Working memory that does not follow the rows]).
short_first = int(os.environ.get("SHORT_FIRST", "0"))
short_kwargs = {k: (v[:, :max(1, seq // 8)] if torch.is_tensor(v) else v) for k, v in kwargs.items()}


def train_iter():
    args = short_kwargs if len(losses) < short_first else kwargs
    if default_loss:
        loss = model.forward_backward(input_kwargs=args)
    else:
        loss = model.forward_backward(input_kwargs=args,
                                      loss_fn=lambda outputs, _: outputs.loss / num_microbatch)
    if os.environ.get("STEP") == "optimizer":
        model.step(optim)
    else:
        model.step(lambda: (optim.step(), optim.zero_grad(), None)[-1])  # (the oracle steps in its next call)
    losses.append(float(loss))


peak_used = 0
# The allocator's peak so far after each call (GiB, allocated/reserved):
# which call set the run's peak, the first (planned before its working
# memory is measured) or a later one (the plan the prediction describes).
peaks_by_call = []
# The plan's prediction for each call as it ran (the largest stage's
# estimate, GiB; pipeline_stats' last_call_planned_peak_bytes): `predicted`
# below is the plan a query returns after the calls, which another
# process's use of the host (the room for checkpoints) can change.
planned_by_call = []


def device_used():
    global peak_used
    if cuda:
        free, total_bytes = torch.cuda.mem_get_info()
        peak_used = max(peak_used, total_bytes - free)
        s = torch.cuda.memory_stats()
        peaks_by_call.append(f"{s.get('allocated_bytes.all.peak', 0) / 2**30:.2f}/"
                             f"{s.get('reserved_bytes.all.peak', 0) / 2**30:.2f}")
    planned = engine_stats().get("last_call_planned_peak_bytes")
    if planned is not None:
        planned_by_call.append(f"{planned / 2**30:.2f}")


def engine_stats():
    return model.pipeline_stats() if impl == "ours" and hasattr(model, "pipeline_stats") else {}


for i in range(warmup):
    t = time.perf_counter()
    train_iter()
    device_used()
    print(f"  warm-up {i + 1}: {time.perf_counter() - t:.2f} s, loss {losses[-1]:.4f}", flush=True)
stats_before = engine_stats()
start = time.perf_counter()
for i in range(timed):
    train_iter()
    device_used()
end = time.perf_counter()
model.synchronize()
# Where the timed calls' time went on the host, per call: the optimizer's
# update and publish, and the workers' wait for published weights (> 0: the
# step bounds the calls) and new calls' wait for earlier ones.
stats_after = engine_stats()
step_times = ""
if stats_after:
    def per_call(key):
        return (stats_after.get(key, 0) - stats_before.get(key, 0)) / timed
    step_times = (f" update_s={per_call('optimizer_update_seconds'):.3f}"
                  f" publish_s={per_call('optimizer_publish_seconds'):.3f}"
                  f" grad_wait_s={per_call('optimizer_grad_wait_seconds'):.3f}"
                  f" weight_wait_s={per_call('weight_wait_seconds'):.3f}"
                  f" start_wait_s={per_call('call_start_wait_seconds'):.3f}"
                  f" call_s={(end - start) / timed:.3f}")
rate = timed * batch * seq / (end - start)
stats = torch.cuda.memory_stats() if cuda else {}
gib = 2**30
segments = torch.cuda.memory._snapshot()["segments"] if cuda else []
# (Read, never set: the package turns expandable segments on itself where
# the process did not configure them; this script exports nothing.)
expandable = sum(1 for s in segments if s.get("is_expandable"))
predicted, described, plan_shape = 0.0, "", ""
# (The plan a call makes where its tail may split rows: the default loss, or
# a loss_fn the first call learned to be linear, Note [A caller's loss over
# row chunks]; before 3af3470 a loss_fn's calls could not, and ran another.)
if impl == "ours":  # the plan's predicted peak: its largest stage with the next one's parameters
    import re
    described = str(model._engine.auto_plan(True, num_microbatch, 0, None, batch // num_microbatch)[1])
    predicted = max([float(x) for x in re.findall(r"([0-9.]+) GiB", described)] or [0])
    # The plan's shape in one word: stages (forward + backward), the fused
    # tail's layers, how many of them it keeps with grad, its row chunks.
    ranges = re.findall(r"(forward|backward)\s+layers \[(\d+), (\d+)\)", described)
    tail = next(((int(a), int(b)) for kind, a, b in ranges if kind == "backward"), None)
    kept = re.search(r"its last (\d+) layer", described)
    chunks = re.search(r"in (\d+) chunks of rows", described)
    # The plan's predicted time of a call, beside the measured call_s.
    predicted_call = re.search(r"predicted ([0-9.eE+-]+) per call", described)
    if predicted_call and step_times:
        step_times += f" predicted_call_s={float(predicted_call.group(1)):.3f}"
    if tail:
        plan_shape = (f" plan={sum(k == 'forward' for k, _, _ in ranges)}+{sum(k == 'backward' for k, _, _ in ranges)}"
                      f",tail={tail[0]}..{tail[1] - 1},kept={kept.group(1) if kept else '-'}"
                      f",chunks={chunks.group(1) if chunks else 1}")
pipeline = stats_after
fused_step = " step=optimizer" if os.environ.get("STEP") == "optimizer" else ""
if os.environ.get("OPTIM"):
    fused_step += f" optim={os.environ['OPTIM']}"
with open("/proc/self/status") as status:  # the process's peak resident host memory
    peak_rss = next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 2**20
print(f"RESULT impl={impl}{fused_step} shape={shape} lora={lora_rank}{' ' + qlora if qlora else ''} cap={cap_gib:g} tokens={batch}x{seq} "
      f"tok_s={rate:.0f}{plan_shape} peak_rss={peak_rss:.1f} peak_alloc={stats.get('allocated_bytes.all.peak', 0) / gib:.2f} "
      f"peak_reserved={stats.get('reserved_bytes.all.peak', 0) / gib:.2f} predicted={predicted:.2f} "
      f"device_used={peak_used / gib:.2f} alloc_retries={stats.get('num_alloc_retries', 0)} "
      f"ooms={stats.get('num_ooms', 0)} expandable_segments={expandable}/{len(segments)}{step_times} "
      f"tails_in_row_chunks={pipeline.get('tail_microbatches_in_row_chunks', '-')} "
      f"peaks_by_call={','.join(peaks_by_call) or '-'} planned_by_call={','.join(planned_by_call) or '-'} "
      f"thin_calls={pipeline.get('calls_with_thin_checkpoints', '-')} losses={','.join(f'{x:.4f}' for x in losses)}", flush=True)
if os.environ.get("PLAN"):
    print("  plan: " + described.replace("\n", "\n  "))

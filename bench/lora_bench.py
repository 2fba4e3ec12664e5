"""LoRA fine-tuning as users run it (issue 18): a peft LoraModel (rank 16,
alpha 32, every linear projection) around a HuggingFace Qwen3 with random
bf16 weights, 8 x 4096 tokens a step with the tokenizer's all-ones
attention_mask. One configuration per process; prints one result line.

  lora_bench.py resident SHAPE BATCH SEQ STEPS
      GPU-resident peft + transformers, gradient checkpointing, no cap, AdamW
      (fused) on the adapters: the baseline.
  lora_bench.py resident_qlora SHAPE BATCH SEQ STEPS
      The same on a 4-bit base (QLoRA): the decoder layers' projections as
      bitsandbytes' Linear4bit (NF4, double quantization, bf16 compute), what
      BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
      bnb_4bit_use_double_quant=True) makes.
  lora_bench.py roundpipe SHAPE CAP_GIB BATCH SEQ STEPS PIN [CHECKPOINT_DIR]
      wrap_model_to_roundpipe(peft_model, pin_model=PIN) on a card capped to
      CAP_GIB, roundpipe.optim.Adam with the async step. With CHECKPOINT_DIR
      the base model is transformers' from_pretrained(dir, dtype=bfloat16)
      (its tensors stay the checkpoint's memory-mapped pages), else random
      weights made on the GPU and moved to the host. Reports tokens/s, the
      weight upload rate from where the weights live
      (measure_weight_upload_rate), and host memory: resident anonymous
      memory, file pages and shared memory (/proc/self/smaps_rollup; the CUDA
      host allocator's pinned blocks count as shared memory) and the peak
      (VmHWM).
  lora_bench.py write SHAPE DIR
      Saves a random-weight bf16 checkpoint of SHAPE to DIR (weights drawn on
      the GPU).
"""
import os
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}
GIB = 2**30
CUDA = torch.cuda.is_available()  # (without: a dry run on simulated devices)


def config_of(shape, seq):
    return Qwen3Config(vocab_size=151936 if shape != "tiny" else 1024, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=max(seq, 4096), use_cache=False,
                       **SHAPES[shape])


def random_model(shape, seq, device):
    """Random bf16 weights, drawn where `device` is (fast on a GPU)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config_of(shape, seq), dtype=torch.bfloat16)
    return model


def host_memory():
    """This process's resident memory in GiB: anonymous, file pages, shared
    memory (the CUDA host allocator's pinned blocks), and the peak RSS."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":"):
                fields[parts[0][:-1]] = int(parts[1]) / 2**20
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20
    anon = fields.get("Pss_Anon", fields.get("Anonymous", 0))
    file = fields.get("Pss_File", fields.get("Rss", 0) - anon)
    return anon, file, fields.get("Pss_Shmem", 0), peak


def describe(memory):
    return f"anon {memory[0]:.2f} file {memory[1]:.2f} shmem {memory[2]:.2f}"


def lora(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                            target_modules="all-linear", task_type="CAUSAL_LM"))


def batch_of(config, batch, seq, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device)}


def rate_of(times, tokens):
    steady = times[len(times) // 2:]  # the first steps plan and measure
    return tokens * len(steady) / sum(steady)


def resident(shape, batch, seq, steps):
    train_resident(lora(random_model(shape, seq, "cuda")), shape, batch, seq, steps)


def resident_qlora(shape, batch, seq, steps):
    import bitsandbytes as bnb
    model = random_model(shape, seq, "cuda")
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=True,
                                      quant_type="nf4", device="cuda")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                             compress_statistics=True, quant_type="nf4")
                setattr(parent, name, q.to("cuda"))  # quantized on the move
    torch.cuda.empty_cache()
    train_resident(lora(model), shape + " NF4", batch, seq, steps)


def train_resident(model, shape, batch, seq, steps):
    """GPU-resident training of a peft model: gradient checkpointing, fused
    AdamW on the adapters; prints the steps and one result line."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    inputs = batch_of(model.config, batch, seq, "cuda")
    times = []
    for step in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        print(f"  step {step + 1}: {times[-1]:.2f} s, loss {loss.item():.4f}", flush=True)
    print(f"resident peft {shape}, {batch} x {seq}: {rate_of(times, batch * seq):,.0f} tokens/s, "
          f"{sum(p.numel() for p in params) / 1e6:.1f}M trainable, peak "
          f"{torch.cuda.max_memory_allocated() / GIB:.1f} GiB (no cap)", flush=True)


def with_roundpipe(shape, cap_gib, batch, seq, steps, pin, checkpoint):
    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
    before = host_memory()
    made = time.perf_counter()
    if checkpoint:
        model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    else:
        model = random_model(shape, seq, "cuda" if CUDA else "cpu").to("cpu")
        if CUDA:
            torch.cuda.empty_cache()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = lora(model)
    loaded = host_memory()
    if CUDA:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / total, 0)
    pipe = wrap_model_to_roundpipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4),
                                   optim_dtype=torch.float32, pin_model=pin)
    wrapped = time.perf_counter() - made
    times = train_steps(pipe, batch_of(model.config, batch, seq), steps)
    trained = host_memory()
    upload = pipe._engine.measure_weight_upload_rate()
    print(f"roundpipe {shape} pin {pin}, cap {cap_gib:g} GiB, {batch} x {seq}: "
          f"{rate_of(times, batch * seq):,.0f} tokens/s; weights {weight_bytes / GIB:.2f} GiB "
          f"{'memory-mapped from disk' if checkpoint else 'made in memory'}, uploaded at "
          f"{upload / 1e9:.1f} GB/s; host memory (GiB) before the model: {describe(before)}; "
          f"loaded: {describe(loaded)}; training: {describe(trained)}, peak RSS {trained[3]:.2f}; "
          f"peak device {torch.cuda.max_memory_allocated() / GIB if CUDA else 0:.2f} GiB; "
          f"ready in {wrapped:.0f} s",
          flush=True)


def train_steps(pipe, inputs, steps):
    """`steps` steps of RoundPipe on `inputs` (async roundpipe.optim.Adam),
    each printed with its time, loss and host memory; returns the times."""
    import roundpipe
    optimizer = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-4)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        loss = pipe.forward_backward(input_kwargs=inputs)
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        times.append(time.perf_counter() - start)
        print(f"  step {step + 1}: {times[-1]:.2f} s, loss {float(loss):.4f}, host (GiB) "
              f"{describe(host_memory())}", flush=True)
    pipe.synchronize()
    return times


def write(shape, out):
    model = random_model(shape, 4096, "cuda" if CUDA else "cpu").to("cpu")
    start = time.perf_counter()
    model.save_pretrained(out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {shape} ({size / GIB:.1f} GiB) to {out} in {time.perf_counter() - start:.0f} s",
          flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "resident":
        resident(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif mode == "resident_qlora":
        resident_qlora(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif mode == "roundpipe":
        with_roundpipe(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                       int(sys.argv[6]), sys.argv[7], sys.argv[8] if len(sys.argv) > 8 else None)
    elif mode == "write":
        write(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)

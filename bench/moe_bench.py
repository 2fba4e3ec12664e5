"""Mixture-of-experts LoRA fine-tuning as users run it (issue 20): a peft
LoraModel (rank 16, alpha 32) on the attention projections and on the
experts' stacked weights (target_parameters) of a HuggingFace Qwen3-MoE or
GPT-OSS with random bf16 weights, BATCH x SEQ tokens a step with the
tokenizer's all-ones attention_mask. One configuration per process; prints
one result line.

  moe_bench.py resident SHAPE BATCH SEQ STEPS
      GPU-resident peft + transformers, gradient checkpointing, no cap, AdamW
      (fused) on the adapters: the baseline where the model fits.
  moe_bench.py roundpipe SHAPE CAP_GIB BATCH SEQ STEPS GROUPED [PIN]
      wrap_model_to_roundpipe(peft_model, grouped_experts=GROUPED,
      pin_model=PIN (default alloc; register for a model over half the
      host's memory: alloc holds two copies while moving in)) on a card
      capped to CAP_GIB, roundpipe.optim.Adam with the async step: tokens/s,
      peak device memory, host memory, the weight upload rate, and the bytes
      of one decoder layer (for the estimate of larger models).

SHAPE: 30B-A3B (Qwen3-30B-A3B: 48 layers, 128 experts, top 8), gpt-oss-20b
(24 layers, 32 experts, top 4, sliding window 128, attention sinks),
235B-A22B-4L (four layers of Qwen3-235B-A22B), or tiny-moe / tiny-oss (a
dry run on the CPU's simulated devices). MICROBATCHES (default min(4,
BATCH)) sets num_microbatch; VERBOSE=1 logs the plan with each layer's
measured time and memory.
"""
import os
import sys
import time

import torch

from lora_bench import GIB, batch_of, describe, host_memory, rate_of, train_resident, train_steps

SHAPES = {
    "30B-A3B": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                  moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                  num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                  norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "gpt-oss-20b": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                                    head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                    sliding_window=128)),
    # Four decoder layers of Qwen3-235B-A22B (94 in all; a small vocabulary:
    # the head is one layer of 95) for the per-layer costs of the estimate.
    "235B-A22B-4L": ("qwen3_moe", dict(vocab_size=8192, hidden_size=4096, intermediate_size=12288,
                                       moe_intermediate_size=1536, num_hidden_layers=4, num_attention_heads=64,
                                       num_key_value_heads=4, head_dim=128, num_experts=128,
                                       num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1000000.0,
                                       rms_norm_eps=1e-6)),
    "tiny-moe": ("qwen3_moe", dict(vocab_size=1024, hidden_size=128, intermediate_size=256,
                                   moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                   norm_topk_prob=True)),
    "tiny-oss": ("gpt_oss", dict(vocab_size=1024, hidden_size=128, intermediate_size=128,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=16)),
}
CUDA = torch.cuda.is_available()


def random_model(shape, seq, device):
    """Random bf16 weights drawn where `device` is (fast on a GPU); GPT-OSS
    with eager attention (transformers' one with its sinks)."""
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    family, sizes = SHAPES[shape]
    torch.manual_seed(0)
    if family == "gpt_oss":
        config = GptOssConfig(max_position_embeddings=131072, use_cache=False, **sizes)
        config._attn_implementation = "eager"
        model_class = GptOssForCausalLM
    else:
        config = Qwen3MoeConfig(max_position_embeddings=max(seq, 4096), tie_word_embeddings=False,
                                use_cache=False, **sizes)
        model_class = Qwen3MoeForCausalLM
    with torch.device(device):
        return model_class._from_config(config, dtype=torch.bfloat16)


def lora(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            target_parameters=["mlp.experts.gate_up_proj",
                                                               "mlp.experts.down_proj"]))


def resident(shape, batch, seq, steps):
    train_resident(lora(random_model(shape, seq, "cuda")), shape, batch, seq, steps)


def with_roundpipe(shape, cap_gib, batch, seq, steps, grouped, pin):
    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
    made = time.perf_counter()
    model = random_model(shape, seq, "cuda" if CUDA else "cpu").to("cpu")
    if CUDA:
        torch.cuda.empty_cache()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    model = lora(model)
    if CUDA:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / total, 0)
        torch.cuda.reset_peak_memory_stats()
    options = {} if CUDA else {"devices": "sim:2"}
    microbatches = int(os.environ.get("MICROBATCHES", min(4, batch)))
    pipe = wrap_model_to_roundpipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=microbatches),
                                   verbose=os.environ.get("VERBOSE") == "1",
                                   optim_dtype=torch.float32, grouped_experts=grouped, pin_model=pin,
                                   **options)
    wrapped = time.perf_counter() - made
    times = train_steps(pipe, batch_of(model.config, batch, seq), steps)
    upload = pipe._engine.measure_weight_upload_rate() if CUDA else 0
    if os.environ.get("VERBOSE") == "1":  # the plan again, now on the measured costs
        print(pipe._engine.auto_plan(True, microbatches, 1, None)[1], flush=True)
    print(f"roundpipe {shape} {'grouped' if grouped else 'looped'} experts, pin {pin}, cap {cap_gib:g} GiB, "
          f"{batch} x {seq}: {rate_of(times, batch * seq):,.0f} tokens/s; peak device "
          f"{torch.cuda.max_memory_allocated() / GIB if CUDA else 0:.2f} GiB; weights "
          f"{weight_bytes / GIB:.2f} GiB, one decoder layer {layer_bytes / GIB:.3f} GiB, uploaded at "
          f"{upload / 1e9:.1f} GB/s; host memory (GiB) {describe(host_memory())}, peak RSS "
          f"{host_memory()[3]:.2f}; ready in {wrapped:.0f} s", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "resident":
        resident(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif mode == "roundpipe":
        with_roundpipe(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                       int(sys.argv[6]), sys.argv[7] not in ("0", "false", "loop"),
                       sys.argv[8] if len(sys.argv) > 8 else "alloc")
    else:
        sys.exit(__doc__)

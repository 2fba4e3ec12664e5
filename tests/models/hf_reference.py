"""Reference data from HuggingFace transformers for the native presets.

  hf_reference.py make OUT     tiny random Qwen3/Llama checkpoints saved by
                               transformers, with inputs (plain, right or left
                               padded, packed documents), logits, loss and
                               parameter gradients (OUT/<case>/reference.safetensors)
  hf_reference.py check DIR REF
                               loads DIR (written by our save_pretrained) with
                               transformers and compares its logits with REF's
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64, rms_norm_eps=1e-6)
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}  # 3 bands: kept, smoothed, scaled
SLIDING = dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=3,
               max_window_layers=1)
# Qwen3-MoE: 4 experts, 2 a token; layer 1 dense (mlp_only_layers), or
# every second layer sparse without renormalised top-k probabilities.
MOE = dict(tie_word_embeddings=False, moe_intermediate_size=16, num_experts=4,
           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
MOE_EVERY_2ND = dict(MOE, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])
# With the router's load-balancing loss, its coefficient large enough to
# show in every gradient.
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.5)
# GPT-OSS: 4 experts of 32, 2 a token; layers 0 and 2 see the last 3 keys
# (sliding_window), layer 1 all; yarn rotary as the released models have it.
GPT_OSS = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
               max_position_embeddings=131072,
               rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                "original_max_position_embeddings": 4096})
# name: (config, model, config extras, input kind)
CASES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False), "plain"),
    "qwen3_tied_padded": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True), "right"),
    "llama_padded": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False), "right"),
    "llama31_tied": (LlamaConfig, LlamaForCausalLM,
                     dict(tie_word_embeddings=True, rope_parameters=LLAMA31_ROPE), "plain"),
    "qwen3_left_padded": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False), "left"),
    "llama31_left_padded": (LlamaConfig, LlamaForCausalLM,
                            dict(tie_word_embeddings=True, rope_parameters=LLAMA31_ROPE), "left"),
    "qwen3_packed": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True), "packed"),
    "llama_packed": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False), "packed"),
    # Layers 1 and 2 see the last 3 keys (themselves included), layer 0 all.
    "qwen3_sliding": (Qwen3Config, Qwen3ForCausalLM, SLIDING, "plain"),
    "qwen3_sliding_left": (Qwen3Config, Qwen3ForCausalLM, SLIDING, "left"),
    "qwen3_sliding_packed": (Qwen3Config, Qwen3ForCausalLM, SLIDING, "packed"),
    "qwen3_moe_padded": (Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE, "right"),
    "qwen3_moe_packed": (Qwen3MoeConfig, Qwen3MoeForCausalLM, MOE_EVERY_2ND, "packed"),
    "qwen3_moe_router_loss": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(MOE, **ROUTER_LOSS),
                              "left"),
    "qwen3_moe_router_loss_packed": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                                     dict(MOE_EVERY_2ND, **ROUTER_LOSS), "packed"),
    "gpt_oss_left_padded": (GptOssConfig, GptOssForCausalLM, GPT_OSS, "left"),
    # (Not packed: transformers' eager attention, the one with GPT-OSS's
    # sinks here, attends across packed documents; the preset keeps them apart.)
    "gpt_oss_router_loss": (GptOssConfig, GptOssForCausalLM, dict(GPT_OSS, **ROUTER_LOSS), "right"),
}
PACKED_DOCUMENTS = (5, 7, 1, 4)  # one row of 17 tokens, a one-token document among them


def inputs(kind):
    """input_ids, attention_mask (None: not passed), position_ids (None: not
    passed) and labels (-100 on padding, and on each packed document's first
    token, as DataCollatorWithFlattening sets them)."""
    gen = torch.Generator().manual_seed(1)
    if kind == "packed":
        ids = torch.randint(0, COMMON["vocab_size"], (1, sum(PACKED_DOCUMENTS)), generator=gen)
        positions = torch.cat([torch.arange(n) for n in PACKED_DOCUMENTS]).unsqueeze(0)
        labels = ids.clone()
        labels[positions == 0] = -100
        return ids, None, positions, labels
    rows = 4 if kind == "left" else 3
    ids = torch.randint(0, COMMON["vocab_size"], (rows, 9), generator=gen)
    mask = torch.ones(rows, 9, dtype=torch.long)
    if kind == "right":
        mask[1, 6:] = 0
        mask[2, 4:] = 0
    elif kind == "left":  # rows of 9, 6, 2 and 8 tokens
        mask[1, :3] = 0
        mask[2, :7] = 0
        mask[3, :1] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return ids, (None if kind == "plain" else mask), None, labels


def make(out):
    for name, (config_class, model_class, extra, kind) in CASES.items():
        torch.manual_seed(0)
        config = config_class(**{**COMMON, **extra})
        model = model_class(config).float()
        # Non-trivial norm weights, biases and attention sinks, so that their
        # gradients and roles show.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
                elif n.endswith("bias") or n.endswith("sinks"):
                    p.uniform_(-0.5, 0.5)
        # (GPT-OSS's sinks are in its eager attention, not in sdpa.)
        model.config._attn_implementation = "eager" if config_class is GptOssConfig else "sdpa"
        model.save_pretrained(f"{out}/{name}", safe_serialization=True)
        ids, mask, positions, labels = inputs(kind)
        # Without a cache, as in training: only then does transformers keep
        # packed documents apart.
        res = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels,
                    use_cache=False)
        res.loss.backward()
        tensors = {"input_ids": ids, "labels": labels,
                   "logits": res.logits.detach().contiguous(), "loss": res.loss.detach().reshape(())}
        if mask is not None:
            tensors["attention_mask"] = mask
        if positions is not None:
            tensors["position_ids"] = positions
        for n, p in model.named_parameters():
            tensors["grad." + n] = p.grad.contiguous()
        if getattr(config, "output_router_logits", False) and ids.size(0) > 1:
            tensors.update(two_microbatches(model, ids, mask, labels))
        save_file(tensors, f"{out}/{name}/reference.safetensors")
        with open(f"{out}/{name}/case.json", "w") as f:
            json.dump({"kind": kind, "tied": extra.get("tie_word_embeddings", False)}, f)
    make_mxfp4(out)


def make_mxfp4(out):
    """gpt_oss_left_padded's checkpoint with its experts' weights replaced by
    random MXFP4 blocks and scales (as GPT-OSS's released checkpoints store
    them, with their quantization_config), and what transformers dequantises
    them to (mxfp4.convert_moe_packed_tensors, bf16) in mxfp4_reference.safetensors."""
    import os
    import shutil
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, dst = f"{out}/gpt_oss_left_padded", f"{out}/gpt_oss_mxfp4"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    os.remove(f"{dst}/reference.safetensors")
    weights = load_file(f"{src}/model.safetensors")
    gen = torch.Generator().manual_seed(2)
    expected = {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inner, outer = weights.pop(name).shape  # [E, in, out]
        blocks = torch.randint(0, 256, (experts, outer, inner // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(120, 130, (experts, outer, inner // 32), dtype=torch.uint8, generator=gen)
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).contiguous()
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    save_file(expected, f"{dst}/mxfp4_reference.safetensors")
    with open(f"{dst}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    with open(f"{dst}/config.json", "w") as f:
        json.dump(config, f, indent=2)


def two_microbatches(model, ids, mask, labels):
    """The loss and gradients of the batch in two microbatches of rows
    (first half, second half) as RoundPipe defines them with the router's
    load-balancing loss: each microbatch's cross-entropy summed over its
    tokens and divided by the batch's labelled tokens N, plus the
    coefficient times its own load-balancing loss (transformers' aux_loss
    of the microbatch) weighted by its labelled tokens over N."""
    model.zero_grad()
    count = lambda l: (l[:, 1:] != -100).sum().item()
    total, half = count(labels), ids.size(0) // 2
    coef = model.config.router_aux_loss_coef
    loss = 0
    for rows in (slice(0, half), slice(half, None)):
        res = model(input_ids=ids[rows], attention_mask=None if mask is None else mask[rows],
                    labels=labels[rows], num_items_in_batch=total, use_cache=False)
        loss = loss + res.loss - coef * res.aux_loss * (1 - count(labels[rows]) / total)
    loss.backward()
    out = {"two_microbatches.loss": loss.detach().reshape(())}
    for n, p in model.named_parameters():
        out["two_microbatches.grad." + n] = p.grad.contiguous()
    return out


def check(directories, reference):
    """Each of `directories` (checkpoints of the model in `reference`) loads in
    transformers and gives the reference's logits; one process for all of
    them (importing transformers is most of the time)."""
    ref = load_file(f"{reference}/reference.safetensors")
    worst = 0.0
    for directory in directories:
        config = json.load(open(f"{directory}/config.json"))
        attention = "eager" if config["model_type"] == "gpt_oss" else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attention).float()
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"], attention_mask=ref.get("attention_mask"),
                           position_ids=ref.get("position_ids"), use_cache=False).logits
        err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
        print(f"{directory}: max relative logits error {err:.3e}")
        worst = max(worst, err)
    sys.exit(0 if worst <= 1e-5 else 1)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:  # check DIRECTORY... REFERENCE
        check(sys.argv[2:-1], sys.argv[-1])

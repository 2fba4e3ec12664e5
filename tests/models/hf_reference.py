"""Reference data from HuggingFace transformers for the native presets.

  hf_reference.py make OUT     tiny random Qwen3/Llama checkpoints saved by
                               transformers, with inputs, logits, loss and
                               parameter gradients (OUT/<case>/reference.safetensors)
  hf_reference.py check DIR REF
                               loads DIR (written by our save_pretrained) with
                               transformers and compares its logits with REF's
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64, rms_norm_eps=1e-6)
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}  # 3 bands: kept, smoothed, scaled
CASES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False), False),
    "qwen3_tied_padded": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True), True),
    "llama_padded": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False), True),
    "llama31_tied": (LlamaConfig, LlamaForCausalLM,
                     dict(tie_word_embeddings=True, rope_parameters=LLAMA31_ROPE), False),
}


def inputs(padded):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, COMMON["vocab_size"], (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    if padded:  # right padding
        mask[1, 6:] = 0
        mask[2, 4:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return ids, mask, labels


def make(out):
    for name, (config_class, model_class, extra, padded) in CASES.items():
        torch.manual_seed(0)
        config = config_class(**COMMON, **extra)
        model = model_class(config).float()
        # Non-trivial norm weights, so that their gradients and roles show.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
        model.config._attn_implementation = "sdpa"
        model.save_pretrained(f"{out}/{name}", safe_serialization=True)
        ids, mask, labels = inputs(padded)
        res = model(input_ids=ids, attention_mask=mask if padded else None, labels=labels)
        res.loss.backward()
        tensors = {"input_ids": ids, "attention_mask": mask, "labels": labels,
                   "logits": res.logits.detach().contiguous(), "loss": res.loss.detach().reshape(())}
        for n, p in model.named_parameters():
            tensors["grad." + n] = p.grad.contiguous()
        save_file(tensors, f"{out}/{name}/reference.safetensors")
        with open(f"{out}/{name}/case.json", "w") as f:
            json.dump({"padded": padded, "tied": extra.get("tie_word_embeddings", False)}, f)


def check(directory, reference):
    ref = load_file(f"{reference}/reference.safetensors")
    padded = json.load(open(f"{reference}/case.json"))["padded"]
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").float()
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"],
                       attention_mask=ref["attention_mask"] if padded else None).logits
    err = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    print(f"max relative logits error {err:.3e}")
    sys.exit(0 if err <= 1e-5 else 1)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        check(sys.argv[2], sys.argv[3])

"""Tiny random HuggingFace models for the preset tests."""
import torch


# Twice the width (every projection's input 64 or more): what bitsandbytes'
# CPU 4-bit kernels need (tests/python/test_bnb_wrap.py).
WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16)


def tiny_qwen3(tie=False, seed=0, **dims):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, tie_word_embeddings=tie, use_cache=False,
                  attn_implementation="sdpa")
    config = Qwen3Config(**{**fields, **dims})
    return Qwen3ForCausalLM(config).float().eval()


def tiny_llama(tie=False, seed=0, rope_scaling=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    extra = {}
    if rope_scaling:
        extra["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie, use_cache=False, attn_implementation="sdpa",
                         rope_theta=10000.0, **extra)
    return LlamaForCausalLM(config).float().eval()


def tiny_qwen3_moe(seed=0, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(1,),
                   **extra):
    """Qwen3-MoE: 4 experts, 2 per token; layer 1 dense (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
                  mlp_only_layers=list(mlp_only_layers), use_cache=False, attn_implementation="sdpa")
    config = Qwen3MoeConfig(**{**fields, **extra})
    return Qwen3MoeForCausalLM(config).float().eval()


def tiny_gpt_oss(seed=0, **extra):
    """GPT-OSS: 4 experts of 32, 2 per token, sliding window 3 on layers 0
    and 2, yarn rotary, non-zero biases and attention sinks; eager attention
    (transformers' only one with the sinks here)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
                          max_position_embeddings=131072, use_cache=False, attn_implementation="eager",
                          **extra)
    model = GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("bias", "sinks")):
                p.uniform_(-0.5, 0.5)
    return model


MODELS = {
    "qwen3": lambda: tiny_qwen3(),
    "qwen3-tied": lambda: tiny_qwen3(tie=True),
    "llama": lambda: tiny_llama(),
    "llama-tied-rope-scaling": lambda: tiny_llama(tie=True, rope_scaling=True),
    "qwen3-moe": lambda: tiny_qwen3_moe(),
    "gpt-oss": lambda: tiny_gpt_oss(),
    "qwen3-moe-every-2nd": lambda: tiny_qwen3_moe(norm_topk_prob=False, decoder_sparse_step=2,
                                                  mlp_only_layers=()),
}


def padded_rows_batch():
    """8 rows of 64 tokens (vocabulary 96) padded on the right to lengths from
    12 to 64, labels -100 on the padding: the row-chunk tests' batch."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (8, 64), generator=g)
    mask = torch.ones(8, 64, dtype=torch.long)
    for row, length in enumerate([64, 40, 12, 64, 50, 33, 64, 20]):
        mask[row, length:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)

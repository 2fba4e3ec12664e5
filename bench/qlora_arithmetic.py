"""Host memory and upload bytes of a model with a quantized base (issue 35),
from its shapes: what roundpipe keeps in host memory (quantized base weights,
full-precision rest, fp32 LoRA adapters with their Adam masters, moments and
gradients) and what one step uploads over PCIe, and the step's upload time at
a given PCIe rate per GPU. The per-format bytes are the formats' own
(Note [4-bit base weights], Note [8-bit base weights]).

    python bench/qlora_arithmetic.py                       # Qwen3-235B-A22B, NF4, 8 GPUs
    python bench/qlora_arithmetic.py --format bf16 --gpus 8 --pcie-gbs 25
"""
import argparse

# Qwen3-235B-A22B's config.json (the shapes that matter).
QWEN3_235B = dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                  head_dim=128, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                  vocab_size=151936, tie_word_embeddings=False)

# Bytes a value: 4 bits = n / 2 codes + a byte a block of 64 + 4 bytes a 256
# blocks (double quantization; the 1 KiB map and offset a weight are noise);
# 8 bits = n + 4 bytes a row (noise).
BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "int8": 1.0, "fp8": 1.0, "bf16": 2.0}


def shapes(c):
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    attention = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    e, m = c["num_experts"], c["moe_intermediate_size"]
    experts = {"gate_up_proj": (e * 2 * m, h), "down_proj": (e * h, m)}
    return attention, experts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="nf4", choices=sorted(BYTES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--pcie-gbs", type=float, default=25.0, help="host-to-device GB/s per GPU (PCIe 4.0 x16: ~25)")
    ap.add_argument("--uploads-per-step", type=float, default=2.0,
                    help="times a step uploads each layer (forward, and backward's recompute)")
    ap.add_argument("--tokens", type=int, default=16 * 4096, help="tokens a step")
    ap.add_argument("--tflops", type=float, default=80.0,
                    help="bf16 matmul TFLOP/s per GPU with float32 accumulation (RTX 4090: ~83)")
    ap.add_argument("--microbatch-tokens", type=int, default=0,
                    help="tokens a microbatch (0: --tokens in one): the checkpoints' arithmetic")
    ap.add_argument("--card-gib", type=float, default=24.0, help="each GPU's memory (the checkpoints' arithmetic)")
    ap.add_argument("--layer-act-gib", type=float, default=4.3,
                    help="what one layer keeps for its backward and works with, at 31,744 tokens a microbatch "
                         "(measured on the H200: 13.4-13.8 GiB a one-layer stage with two layers' 4.63 GiB "
                         "of bf16 weights); scaled by the tokens")
    a = ap.parse_args()
    c = QWEN3_235B
    attention, experts = shapes(c)
    L, h = c["num_hidden_layers"], c["hidden_size"]
    n_attn = sum(o * i for o, i in attention.values())
    n_experts = sum(o * i for o, i in experts.values())
    quantized = L * (n_attn + n_experts)
    rest = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2) + L * (c["num_experts"] * h + 4 * h)
    lora = L * sum(a.rank * (o + i) for o, i in attention.values())  # all-linear: the attention projections
    gib = 1024 ** 3
    base = quantized * BYTES[a.format] + rest * 2
    adapters = lora * 16  # fp32 weights, gradients, Adam's two moments
    per_layer = (n_attn + n_experts) * BYTES[a.format]
    upload = L * per_layer * a.uploads_per_step
    print(f"Qwen3-235B-A22B, {a.format} base, LoRA r={a.rank} on the attention projections")
    print(f"  parameters: {(quantized + rest) / 1e9:.1f} B ({quantized / 1e9:.1f} B quantized), adapters {lora / 1e6:.1f} M")
    print(f"  host memory: base {base / gib:.1f} GiB + adapters and their optimizer {adapters / gib:.2f} GiB "
          f"= {(base + adapters) / gib:.1f} GiB")
    print(f"  one decoder layer uploads {per_layer / gib:.2f} GiB; a step {upload / gib:.0f} GiB "
          f"({a.uploads_per_step:g} uploads a layer)")
    print(f"  upload time a step over {a.gpus} GPUs at {a.pcie_gbs:g} GB/s each: "
          f"{upload / (a.gpus * a.pcie_gbs * 1e9):.1f} s")
    # Matmul work: forward 2, backward 4, recompute 2 FLOP a active parameter a token.
    e, k = c["num_experts"], c["num_experts_per_tok"]
    active = L * (n_attn + n_experts * k / e) + c["vocab_size"] * h
    flops = 8 * active * a.tokens
    print(f"  matmul work a step ({a.tokens} tokens, {active / 1e9:.1f} B active parameters): {flops / 1e15:.1f} PFLOP, "
          f"{flops / (a.gpus * a.tflops * 1e12):.1f} s on {a.gpus} GPUs at {a.tflops:g} TFLOP/s (at best)")
    print(f"  the dequantized weights of one layer on its GPU: {(n_attn + n_experts) * 2 / gib:.2f} GiB in bf16")
    checkpoints(a, L, h, per_layer, (n_attn + n_experts) * 2)


def checkpoints(a, L, h, per_layer, dequantized):
    """The host's checkpoints a call keeps from its forward to its backward
    (Note [Thin checkpoints]): in layer grain every layer's input of every
    microbatch; in layer-from-stage grain each backward stage's input, the
    stages as long as a card holds: the plan's limit (the budget less a
    tenth, the budget the card less 1.5 GiB: Note [Device memory budget]) >=
    k layers' weights and the next stage's (2 k), one layer's activations
    and working memory and its dequantized weights, and the rerun's k - 1
    inputs of a microbatch on the card."""
    gib = 1024 ** 3
    tokens = a.microbatch_tokens or a.tokens
    microbatches = max(a.tokens // tokens, 1)
    hidden = tokens * h * 2  # one layer's input, one microbatch, bf16
    limit = (a.card_gib - 1.5) * 0.9 * gib
    one_layer = a.layer_act_gib * gib * tokens / 31744 + dequantized
    k = 1
    while k < L and 2 * (k + 1) * per_layer + one_layer + k * hidden <= limit:
        k += 1
    stages = -(-L // k)
    layer_grain = (L + 1) * hidden * microbatches
    thin = stages * hidden * microbatches
    print(f"  host checkpoints, {microbatches} x {tokens} tokens a call: layer grain {layer_grain / gib:.0f} GiB; "
          f"layer_from_stage {thin / gib:.0f} GiB ({stages} backward stages of <= {k} layers on "
          f"{a.card_gib:g} GiB cards, each rerunning its layers but the last once more)")


if __name__ == "__main__":
    main()

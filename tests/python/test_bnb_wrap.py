"""A model transformers loads with bitsandbytes (BitsAndBytesConfig
load_in_4bit, load_in_8bit), peft's LoRA on top, wraps as it is (issue 35):
the preset computes on bitsandbytes' own quantized tensors (no copy, no
requantization).

The oracle is peft on the same model with each quantized projection
replaced by a float32 one holding bitsandbytes' own dequantization of its
weight, so losses and adapter gradients are peft's to the order of float32
sums (test_lora's bounds, the gradients' at their own scale):
4 bits: bitsandbytes' CPU 4-bit matmul need not be float32-exact (on an
AVX-512 BF16 CPU its LoRA gradients were 1% off those of its own
dequantized weights), which says nothing about the preset's.
8 bits: bitsandbytes multiplies int8 weights by int8-rounded activations;
the preset by the activations as they are (Note [8-bit base weights]).

The models are twice hf_models' tiny width (WIDE: every projection's input
64 or more): bitsandbytes 0.50.2's CPU 4-bit dequantization, on an AVX-512
BF16 CPU, gives a weight whose rows are shorter than its 64-value block
every row the first block's scale (its round trip of a 32 x 32 weight was
off by 1.7 where the values reach 3), so the oracle would be wrong there."""
import copy

import pytest
import torch
from torch import nn

from roundpipe import wrap_model_to_roundpipe

from hf_models import WIDE, tiny_qwen3, tiny_qwen3_moe
from test_lora import check_against_peft, lora_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_quantized(tmp_path, quantization, make=tiny_qwen3):
    base = make(seed=3, **WIDE)
    with torch.no_grad():  # (projections of std 0.2, not 0.02: the loss depends on them)
        for name, p in base.named_parameters():
            if "_proj" in name:
                p.mul_(10)
    base.save_pretrained(tmp_path / "base")
    return transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=quantization, device_map="cpu", dtype=torch.float32,
        attn_implementation="sdpa")


def run(model, oracle, devices):
    """test_lora's check, the gradients at their own scale. (Training mode:
    bitsandbytes repacks 4-bit weights for its CPU inference kernel in eval
    mode on some CPUs.)"""
    model.train()
    oracle.train()
    check_against_peft(model, devices, oracle, own_scale=True)


def dequantized_oracle(model):
    """A copy of `model` whose bitsandbytes projections are float32 Linears
    of bitsandbytes' dequantized weights."""
    F = pytest.importorskip("bitsandbytes.functional")
    oracle = copy.deepcopy(model)
    replaced = 0
    for module in oracle.modules():
        base = getattr(module, "base_layer", None)
        kind = type(getattr(base, "weight", None)).__name__
        if kind not in ("Params4bit", "Int8Params"):
            continue
        plain = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
        if kind == "Params4bit":
            weight = F.dequantize_4bit(base.weight.data, base.weight.quant_state)
        else:
            scale = base.weight.SCB if base.weight.SCB is not None else base.state.SCB
            weight = F.int8_vectorwise_dequant(base.weight.data, scale)
        plain.weight.data = weight.float()
        if base.bias is not None:
            plain.bias.data = base.bias.data.float()
        plain.requires_grad_(False)
        module.base_layer = plain
        replaced += 1
    return oracle, replaced


@pytest.mark.parametrize("quant_type,double_quant", [("nf4", True), ("fp4", False)])
def test_a_4bit_model_with_peft_trains_as_peft_on_bitsandbytes(tmp_path, devices, quant_type, double_quant):
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                        bnb_4bit_use_double_quant=double_quant,
                                        bnb_4bit_compute_dtype=torch.float32)
    model = lora_model(PROJECTIONS, base=load_quantized(tmp_path, q))
    oracle, replaced = dequantized_oracle(model)
    assert replaced == 3 * 7
    run(model, oracle, devices)


def bnb_tensors(model):
    """{name: data pointer} of the bitsandbytes parameters and their scales."""
    out = {}
    for n, m in model.named_modules():
        w = getattr(m, "weight", None)
        if type(w).__name__ == "Params4bit" and "base_layer" in n:
            out[n] = w.data_ptr()
            out[n + ".absmax"] = w.quant_state.absmax.data_ptr()
        elif type(w).__name__ == "Int8Params" and "base_layer" in n:
            out[n] = w.data_ptr()
            out[n + ".SCB"] = (w.SCB if w.SCB is not None else m.state.SCB).data_ptr()
    return out


@pytest.mark.parametrize("load", ["load_in_4bit", "load_in_8bit"])
def test_bitsandbytes_tensors_are_the_homes_moved_not_copied(tmp_path, load):
    """The preset's homes are bitsandbytes' own tensors: pin_model="off"
    leaves them where they are, and so does "register" (it pins them in
    place where there is a GPU); "alloc" (the default) moves them into the
    pinned arena (unpinned on simulated devices), so that the host holds
    one copy of the quantized weights, not two."""
    for pin in ("off", "register", "alloc"):
        model = lora_model(PROJECTIONS, base=load_quantized(tmp_path, transformers.BitsAndBytesConfig(**{load: True})))
        before = bnb_tensors(model)
        assert len(before) == 2 * 3 * 7
        wrap_model_to_roundpipe(model, devices="sim:1", pin_model=pin)
        after = bnb_tensors(model)
        moved = {n for n in before if after[n] != before[n]}
        assert moved == (set(before) if pin == "alloc" else set()), pin


def test_an_8bit_model_with_peft_trains_on_bitsandbytes_weights(tmp_path, devices):
    model = lora_model(PROJECTIONS, base=load_quantized(tmp_path, transformers.BitsAndBytesConfig(load_in_8bit=True)))
    oracle, replaced = dequantized_oracle(model)
    assert replaced == 3 * 7
    run(model, oracle, devices)


def test_a_4bit_moe_model_keeps_its_experts_and_trains_as_peft(tmp_path):
    """transformers' bitsandbytes loading quantizes nn.Linear only: the
    stacked experts stay in float32, and so they do in the preset."""
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                        bnb_4bit_compute_dtype=torch.float32)
    model = lora_model(PROJECTIONS, base=load_quantized(tmp_path, q, tiny_qwen3_moe))
    oracle, replaced = dequantized_oracle(model)
    assert replaced > 0
    run(model, oracle, "sim:2")


def test_what_the_preset_cannot_take_is_refused(tmp_path):
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["lm_head", "q_proj"])
    with pytest.raises(NotImplementedError, match="left .*q_proj.* in full precision"):
        wrap_model_to_roundpipe(load_quantized(tmp_path, q), devices="sim:1")

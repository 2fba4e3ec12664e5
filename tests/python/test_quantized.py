"""4-bit base weights (Note [4-bit base weights]): roundpipe._C's NF4/FP4
layout against the QLoRA paper's construction and a plain PyTorch oracle
(always), and against bitsandbytes itself where it installs (its CPU path:
the packed bytes of a weight it quantizes, and our dequantization of its
quantized states, bit for bit)."""
import pytest
import torch

from roundpipe import _C


def nf4_from_the_paper():
    """NF4 as the QLoRA paper builds it (bitsandbytes' create_normal_map,
    offset 0.9677083): 8 positive and 7 negative normal quantiles and 0,
    scaled to [-1, 1]; float64 here."""
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    offset = 0.9677083
    positive = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.sort(torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative])).values
    return values / values.abs().max()


def dynamic_map_recipe():
    """bitsandbytes' create_dynamic_map(signed=True), as its docs and paper
    describe it, in float32 torch ops."""
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2 ** i + 1)
        means = (b[:-1] + b[1:]) / 2.0
        data += (10 ** (i - 6) * means).tolist()
        data += (-(10 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]
    return torch.sort(torch.tensor(data, dtype=torch.float32)).values


def oracle_codes(w, quant_type, blocksize=64):
    """Each value times 1 / its block's absmax, to the nearest code (a tie
    to the lower), packed two a byte, the even element high."""
    table = _C.code_table(quant_type)
    flat = w.float().reshape(-1)
    n = flat.numel()
    pad = (-n) % blocksize
    blocks = torch.cat([flat, torch.zeros(pad)]).reshape(-1, blocksize)
    absmax = blocks.abs().amax(1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).reshape(-1)[:n]
    if quant_type == "nf4":
        codes = torch.bucketize(scaled, (table[:-1] + table[1:]) / 2)
    else:  # magnitudes ranked, the sign in bit 3
        mags, order = torch.sort(table[:8])
        rank = torch.bucketize(scaled.abs(), (mags[:-1] + mags[1:]) / 2)
        codes = order[rank] | torch.where(scaled < 0, 8, 0)
    if n % 2:
        codes = torch.cat([codes, torch.bucketize(torch.zeros(1), (table[:-1] + table[1:]) / 2)
                           if quant_type == "nf4" else torch.zeros(1, dtype=codes.dtype)])
    packed = (codes[0::2] << 4 | codes[1::2]).to(torch.uint8)
    return packed, absmax


def test_nf4_is_the_papers_normal_quantiles_and_the_scale_map_is_bitsandbytes_recipe():
    torch.testing.assert_close(_C.code_table("nf4").double(), nf4_from_the_paper(), rtol=0, atol=2e-7)
    fp4 = torch.tensor([0, 0.0625, 8, 12, 4, 6, 2, 3]) / 12
    assert torch.equal(_C.code_table("fp4"), torch.cat([fp4, -fp4]))  # (sign in bit 3)
    assert torch.equal(_C.dynamic_map_signed(), dynamic_map_recipe())


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codes_scales_and_values_are_the_oracles(quant_type, dtype):
    torch.manual_seed(0)
    w = (torch.randn(37, 129) * 0.05).to(dtype)  # an odd count, a short last block
    q = _C.quantize_4bit(w, quant_type, 64, False)
    packed, absmax = oracle_codes(w, quant_type)
    assert torch.equal(q["packed"], packed) and torch.equal(q["absmax"], absmax)
    assert q["shape"] == [37, 129] and q["dtype"] == str(dtype).replace("torch.", "")
    table = _C.code_table(quant_type)
    codes = torch.stack([packed >> 4, packed & 15], 1).reshape(-1)[:w.numel()].long()
    expected = (table[codes] * absmax.repeat_interleave(64)[:w.numel()]).to(dtype).reshape(w.shape)
    assert torch.equal(_C.dequantize_4bit(q), expected)


def test_double_quantized_scales_are_the_nearest_of_the_dynamic_map():
    torch.manual_seed(1)
    w = torch.randn(300, 128) * torch.rand(300, 1)
    plain = _C.quantize_4bit(w, "nf4", 64, False)
    q = _C.quantize_4bit(w, "nf4", 64, True)
    offset = plain["absmax"].mean()
    assert q["nested_offset"] == pytest.approx(float(offset), rel=0, abs=0)
    centered = (plain["absmax"] - offset).reshape(-1)
    blocks = torch.nn.functional.pad(centered, (0, (-centered.numel()) % 256)).reshape(-1, 256)
    amax2 = blocks.abs().amax(1)
    assert torch.equal(q["nested_absmax"], amax2)
    scaled = (blocks * (1.0 / amax2)[:, None]).reshape(-1)[:centered.numel()]
    code = q["nested_code"]
    nearest = torch.bucketize(scaled, (code[:-1] + code[1:]) * 0.5)
    assert torch.equal(q["absmax"].long(), nearest)


def test_bitsandbytes_quantized_weights_dequantize_to_its_values_bit_for_bit():
    F = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(2)
    w = torch.randn(64, 320) * 0.02
    assert torch.equal(_C.dynamic_map_signed(), F.create_dynamic_map(signed=True))
    for quant_type in ("nf4", "fp4"):
        assert torch.equal(_C.code_table(quant_type), F.get_4bit_type(quant_type, device="cpu"))
        # Their codes of a weight are ours (NF4 byte for byte; FP4's codes of
        # values under 0.0026 of a block's maximum differ in sign on their
        # CPU path, both 0).
        packed, state = F.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=False)
        ours = _C.quantize_4bit(w, quant_type, 64, False)
        assert torch.equal(ours["absmax"], state.absmax)
        if quant_type == "nf4":
            assert torch.equal(ours["packed"], packed.reshape(-1))
        assert torch.equal(_C.dequantize_4bit(ours), F.dequantize_4bit(packed, state))
        # Their double-quantized states, in each dtype, dequantize to their values.
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            packed, state = F.quantize_4bit(w.to(dtype), blocksize=64, quant_type=quant_type,
                                            compress_statistics=True)
            theirs = dict(quant_type=quant_type, blocksize=64, shape=list(w.shape),
                          dtype=str(dtype).replace("torch.", ""), packed=packed, absmax=state.absmax,
                          nested_absmax=state.state2.absmax, nested_code=state.state2.code,
                          nested_offset=float(state.offset))
            assert torch.equal(_C.dequantize_4bit(theirs), F.dequantize_4bit(packed, state)), (quant_type, dtype)


def test_int8_is_bitsandbytes_llm_int8_weight_bit_for_bit():
    """Note [8-bit base weights]: our int8 codes and row scales of a weight
    are bitsandbytes' (Int8Params quantizes the float16 weight), and the
    weight comes back as its int8_vectorwise_dequant gives it."""
    F = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(3)
    w = torch.randn(48, 200) * torch.logspace(-3, 0, 48)[:, None]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ours = _C.quantize_8bit(w.to(dtype), "int8")
        codes, scale, _ = F.int8_vectorwise_quant(w.to(dtype).to(torch.float16))
        assert torch.equal(ours["values"], codes), dtype
        assert torch.equal(ours["scale"], scale), dtype
        back = _C.dequantize_8bit(dict(ours, dtype="float32"))
        assert torch.equal(back, F.int8_vectorwise_dequant(codes, scale)), dtype


def test_fp8_is_the_row_scaled_to_448_in_e4m3():
    """fp8: each row over absmax / 448, rounded by PyTorch's own e4m3
    conversion (the oracle), and back as values times the scale."""
    torch.manual_seed(4)
    w = torch.randn(16, 100) * torch.logspace(-4, 1, 16)[:, None]
    ours = _C.quantize_8bit(w, "fp8")
    scale = w.abs().amax(1) / 448
    assert torch.equal(ours["scale"], scale)
    e4m3 = (w / scale[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(ours["values"], e4m3.view(torch.uint8))
    assert torch.equal(_C.dequantize_8bit(ours), e4m3.float() * scale[:, None])

"""roundpipe.optim.Adam8bit / AdamW8bit against bitsandbytes' own (its CPU
update is the oracle): the quantization maps bit for bit; each update from
the same state (teacher-forced) to the rounding of the arithmetic; the state
dict in both directions; model.step(optimizer) against the step function;
TrainingArguments(optim="adamw_8bit") against plain transformers."""
import copy

import bitsandbytes as bnb
import pytest
import roundpipe
import torch
from bitsandbytes.functional import create_dynamic_map
from conftest import ADAM_EPS, adam_weight_tol, make_model
from hf_models import tiny_qwen3
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, TrainingArguments, train
from roundpipe import _C

# Parameters from 8-bit (>= 4096 elements, a last block short or whole) to
# float32 state (below min_8bit_size), one of them a matrix.
SIZES = [(4096,), (5000,), (40, 130), (100,)]
# The rounding of one update, relative to the largest weight: the decay and
# the update round once each (an ulp each), the update itself is lr times a
# few ulps of its moments.
FEW_ULPS = 4 * 2.0 ** -23


def make_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SIZES]


def test_maps_are_bitsandbytes_create_dynamic_map():
    for signed in (True, False):
        ours = _C.dynamic_map(signed=signed)
        assert ours.dtype == torch.float32 and torch.equal(ours, create_dynamic_map(signed=signed))


def copy_state(source, target):
    """Copies one optimizer's per-parameter state into the other (same keys)."""
    for p, q in zip(source.param_groups[0]["params"], target.param_groups[0]["params"]):
        q.data.copy_(p.data)
        for key, value in source.state[p].items():
            if torch.is_tensor(value):
                target.state[q][key].copy_(value)
            else:
                target.state[q][key] = value


def moments_after(state, grad, betas):
    """The float64 moments a step computes from `state` (8-bit) and `grad`,
    before they are stored: the values both optimizers quantize."""
    def decode(codes, absmax, qmap):
        scale = absmax.double().repeat_interleave(256)[:codes.numel()]
        return qmap.double()[codes.reshape(-1).long()] * scale
    g = grad.reshape(-1).double()
    m = decode(state["state1"], state["absmax1"], state["qmap1"]) * betas[0] + (1 - betas[0]) * g
    v = decode(state["state2"], state["absmax2"], state["qmap2"]) * betas[1] + (1 - betas[1]) * g * g
    return m, v


def distance_to_code(codes, values, absmax, qmap):
    """|value / absmax - the code's value| of each element."""
    scale = absmax.double().repeat_interleave(256)[:values.numel()]
    return (values / scale - qmap.double()[codes.reshape(-1).long()]).abs()


@pytest.mark.parametrize("kind,weight_decay", [("Adam8bit", 0.0), ("AdamW8bit", 0.1)])
def test_each_update_is_bitsandbytes(kind, weight_decay):
    """Teacher-forced: each step starts bitsandbytes from our state. The
    weights, the scales and the float32 moments of small parameters agree to
    the rounding of the arithmetic. Each 8-bit moment is stored as its
    nearest code, as bitsandbytes documents; its CPU quantizer picks another
    code for about 0.2% of the elements (by up to two codes, never a nearer
    one), so the codes agree but there, and ours are the nearest (to the
    rounding of the float32 moment: a few ulps of the code's scale)."""
    ours_params, theirs_params = make_params(0), make_params(0)
    betas = (0.9, 0.99)
    options = dict(lr=1e-2, betas=betas, eps=1e-8, weight_decay=weight_decay)
    ours = getattr(roundpipe.optim, kind)(ours_params, **options)
    theirs = getattr(bnb.optim, kind)(theirs_params, **options)
    g = torch.Generator().manual_seed(1)
    differing = total = 0
    for step in range(1, 9):
        for p, q in zip(ours_params, theirs_params):
            p.grad = torch.randn(p.shape, generator=g) * (1e-4 if step % 3 == 0 else 1.0)
            q.grad = p.grad.clone()
        if step > 1:
            copy_state(ours, theirs)
        before = {i: {k: v.clone() for k, v in ours.state[p].items() if torch.is_tensor(v)}
                  for i, p in enumerate(ours_params) if step > 1}
        ours.step()
        theirs.step()
        for i, (p, q) in enumerate(zip(ours_params, theirs_params)):
            a, b = ours.state[p], theirs.state[q]
            assert a["step"] == b["step"] == step
            assert sorted(a) == sorted(b), "the state's keys are bitsandbytes'"
            scale = float(q.abs().max())
            assert float((p - q).abs().max()) <= FEW_ULPS * scale, (p.shape, step)
            if a["state1"].dtype == torch.float32:  # below min_8bit_size: float32 moments
                assert p.numel() < 4096
                for key in ("state1", "state2"):  # (as the weights: an ulp or two of the largest terms)
                    torch.testing.assert_close(a[key], b[key], rtol=0, atol=FEW_ULPS * float(b[key].abs().max()))
                continue
            assert a["state1"].dtype == torch.uint8 and a["state1"].shape == p.shape
            for key in ("absmax1", "absmax2"):
                torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=0)
            for key in ("qmap1", "qmap2"):
                assert torch.equal(a[key], b[key])
            zero = {k: torch.zeros_like(a[k]) for k in ("state1", "state2", "absmax1", "absmax2")}
            m, v = moments_after(before.get(i, {**a, **zero}), p.grad, betas)
            for key, values, absmax, qmap in (("state1", m, a["absmax1"], a["qmap1"]),
                                              ("state2", v, a["absmax2"], a["qmap2"])):
                mine = distance_to_code(a[key], values, absmax, qmap)
                bnbs = distance_to_code(b[key], values, absmax, qmap)
                # (A code's spacing is 1e-7 at least; the float32 moment is a few ulps off.)
                assert float((mine - bnbs).max()) <= 1e-6, (key, p.shape, step)
                differing += int((a[key] != b[key]).sum())
                total += a[key].numel()
    assert differing <= total / 100, f"{differing} of {total} codes differ"


def test_state_dicts_load_both_ways():
    """Our state_dict() loads into bitsandbytes' optimizer and theirs into
    ours; either way the next steps are the same to the rounding of an update."""
    ours_params, theirs_params = make_params(2), make_params(2)
    ours = roundpipe.optim.AdamW8bit(ours_params, lr=1e-2)
    theirs = bnb.optim.AdamW8bit(theirs_params, lr=1e-2)
    g = torch.Generator().manual_seed(3)

    def step_both():
        for p, q in zip(ours_params, theirs_params):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()

    step_both()
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    for p, q in zip(ours_params, theirs_params):
        q.data.copy_(p.data)
    step_both()
    for p, q in zip(ours_params, theirs_params):
        assert float((p - q).abs().max()) <= FEW_ULPS * float(q.abs().max())
        assert ours.state[p]["step"] == theirs.state[q]["step"] == 2

    fresh_params = [p.detach().clone() for p in theirs_params]
    fresh = roundpipe.optim.AdamW8bit(fresh_params, lr=1e-2)
    fresh.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for p, q in zip(fresh_params, theirs_params):
        for key, value in theirs.state[q].items():
            mine = fresh.state[p][key]
            assert torch.equal(mine, value) if torch.is_tensor(value) else mine == value, key
            if torch.is_tensor(value):
                assert mine.dtype == value.dtype, key  # the scales stay float32


def test_bad_arguments_name_the_fix():
    p = [torch.zeros(8)]
    with pytest.raises(ValueError, match="amsgrad"):
        roundpipe.optim.Adam8bit(p, amsgrad=True)
    with pytest.raises(ValueError, match="optim_bits"):
        roundpipe.optim.AdamW8bit(p, optim_bits=8)
    with pytest.raises(ValueError, match="optim must be one of .*adamw_8bit"):
        TrainingArguments(optim="adam8").validate()


# One plan for both runs, so that their gradients are bit for bit the same.
PINNED = RoundPipeRunConfig(execute_plan=ModelExecutePlan([range(0, 4)], [range(4, 6), range(2, 4), range(0, 2)]))


def run(fused, is_async):
    torch.manual_seed(0)
    model = make_model(dim=72, dtype=torch.bfloat16)  # 72 x 72 matrices: 8-bit state
    pipe = RoundPipe(model, devices="sim:2", optim_dtype=torch.float32, model_run_config=PINNED)
    masters = list(pipe.optim_parameters())
    optimizer = roundpipe.optim.AdamW8bit(masters, lr=1e-3, eps=ADAM_EPS, min_8bit_size=1024)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g).bfloat16(), torch.randn(6, 3, generator=g).bfloat16()
    losses = []
    for _ in range(4):
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).float().mean())
        losses.append(float(loss))
        if fused:
            pipe.step(optimizer, is_async=is_async)
        else:
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=is_async)
    pipe.synchronize()
    assert any(s["state1"].dtype == torch.uint8 for s in optimizer.state.values())
    return losses, [p.detach().clone() for p in model.parameters()], [optimizer.state[m] for m in masters]


@pytest.mark.parametrize("is_async", [True, False])
def test_a_fused_step_is_the_step_function_bit_for_bit(is_async):
    fused, plain = run(True, is_async), run(False, is_async)
    assert fused[0] == plain[0]
    assert fused[0][-1] < fused[0][0]
    for a, b in zip(fused[1], plain[1]):
        assert torch.equal(a, b)
    for mine, theirs in zip(fused[2], plain[2]):
        assert sorted(mine) == sorted(theirs)
        for name, value in theirs.items():
            assert torch.equal(mine[name], value) if torch.is_tensor(value) else mine[name] == value, name


def test_train_with_adamw_8bit_is_transformers_with_the_same_optimizer(tmp_path):
    """roundpipe.train(optim="adamw_8bit") against the same steps in plain
    transformers with roundpipe.optim.AdamW8bit on its parameters (the
    optimizer itself is checked against bitsandbytes above): the losses and
    the weights, as the float32 run is checked against torch's AdamW."""
    from test_train_tools import _examples, _plain_oracle

    data = _examples(32)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), batch_size=4, max_steps=4, lr=3e-3,
                             lr_schedule="constant",
                             weight_decay=0.1, max_grad_norm=1.0, packing=False, num_microbatch=2,
                             sync_step=True, save_model=False, tensorboard=False, adam_epsilon=ADAM_EPS,
                             optim="adamw_8bit")
    model = tiny_qwen3(hidden_size=64, intermediate_size=128)  # embeddings and MLPs 8-bit, the rest not
    oracle = copy.deepcopy(model)
    result = train(model, data, args)

    losses, _, _, opt = _plain_oracle(oracle, data, args, 4, optimizer_class=roundpipe.optim.AdamW8bit)
    assert any(s["state1"].dtype == torch.uint8 for s in opt.state.values())
    assert any(s["state1"].dtype == torch.float32 for s in opt.state.values())
    assert result.losses == pytest.approx(losses, rel=1e-4)
    for p, q in zip(model.parameters(), oracle.parameters()):
        p, q = p.detach(), q.detach()
        # (A code of another rounding moves a weight by lr at most: rare, so
        # the bound on the float32 run's weights holds almost everywhere.)
        close = (p - q).abs() <= adam_weight_tol(steps=4, lr=3e-3)  # 4 updates
        assert float(close.float().mean()) >= 0.999
        assert float((p - q).abs().max()) <= 2 * 4 * 3e-3

"""The original library's RoundPipe, optimizer and run-config API (its
ORIGINAL_API facts) on our package: names, signatures, defaults, semantics."""
import copy
import warnings

import pytest
import torch

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig

from conftest import ADAM_EPS, assert_close, make_model, mse


def test_model_attributes_and_the_forwarding_target(devices):
    model = make_model()
    model.note = "seq"
    pipe = RoundPipe(model, devices=devices, optim_dtype=torch.float32)
    assert pipe.model is model and pipe.original_model is model
    assert pipe.optim_dtype == torch.float32
    assert len(pipe.layers) == len(model) and pipe.layers[0] is model[0]
    target = torch.nn.Linear(2, 2)
    target.note = "original"
    pipe.set_original_model(target)
    assert pipe.original_model is target
    assert pipe.note == "original"  # reads: the original model first
    pipe.note = "both"  # writes and deletes: to both
    assert (model.note, target.note) == ("both", "both")
    del pipe.note
    assert not hasattr(model, "note") and not hasattr(target, "note")
    with pytest.raises(AttributeError):
        del pipe.no_such_attribute


def test_step_passes_extra_arguments_to_the_step_function(devices):
    pipe = RoundPipe(make_model(), devices=devices)
    seen = []
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    pipe.step(lambda a, b=0: seen.append((a, b)), False, 3, b=4)
    pipe.synchronize()
    assert seen == [(3, 4)]


def test_optim_named_parameters_takes_prefix_and_remove_duplicate():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    model[2].weight = model[0].weight  # tied: one master
    pipe = RoundPipe(model, devices="sim:1")
    plain = pipe.optim_named_parameters()
    assert [n for n, _ in plain] == ["0.weight", "0.bias", "2.bias"]
    assert [n for n, _ in pipe.optim_named_parameters(prefix="net")] == [
        "net.0.weight", "net.0.bias", "net.2.bias"]
    every = dict(pipe.optim_named_parameters(remove_duplicate=False))
    assert sorted(every) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert every["2.weight"] is every["0.weight"]


def test_adam_takes_the_original_signature():
    params = [torch.nn.Parameter(torch.randn(3))]
    with pytest.warns(UserWarning, match="foreach and fused are ignored"):
        roundpipe.optim.Adam(params, foreach=True, fused=True)
    with pytest.raises(AssertionError, match="capturable"):
        roundpipe.optim.Adam(params, capturable=True)
    with pytest.raises(AssertionError, match="differentiable"):
        roundpipe.optim.Adam(params, differentiable=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = roundpipe.optim.Adam(params, lr=torch.tensor([0.1]), betas=(torch.tensor([0.8]), 0.9))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.8)
    roundpipe.optim.AdamW(params, foreach=None, fused=None)


def test_merge_output_true_is_automatic_and_beats_a_model_level_false(devices):
    model = make_model()
    plain = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=False))
    x = torch.randn(6, 4)
    with torch.no_grad():
        packed = pipe(x)
        merged = pipe(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=True))
        expected = plain(x)
    assert isinstance(packed, list) and len(packed) == 2  # the original's list subclass
    assert packed.synchronize() is packed and len(packed.transfer_event) == 2
    assert_close(torch.cat(list(packed)), expected)
    assert_close(merged, expected)


def test_model_execute_plan_the_original_way():
    from roundpipe import ModelExecutePlan

    plan = ModelExecutePlan()  # empty, then filled in
    assert plan.fwd_plan == [] and plan.bwd_plan == []
    plan.fwd_plan = [range(0, 2), range(2, 6)]
    plan.check_valid(6, "infer")
    plan.bwd_plan = [range(3, 6), range(0, 3)]
    plan.check_valid(6, "train")
    with pytest.raises(ValueError):
        plan.check_valid(6, "fused")  # the forward must stop before bwd_plan[0]
    with pytest.raises(ValueError):
        ModelExecutePlan([range(0, 2)], []).check_valid(6, "infer")  # layers 2..5 uncovered
    with pytest.raises(ValueError, match="run_type"):
        plan.check_valid(6, "eval")

    first = RoundPipe(make_model(), devices="sim:2")
    second = RoundPipe(make_model(), devices="sim:2")
    assert ModelExecutePlan.auto("fused") == []
    one = ModelExecutePlan.auto("fused", first, upper_threshold=1.2)
    one.check_valid(first.num_layers, "fused")
    infer = ModelExecutePlan.auto("infer", first)
    assert infer.bwd_plan == []
    infer.check_valid(first.num_layers, "infer")
    both = ModelExecutePlan.auto("train", first, second, min_stages=2)
    assert len(both) == 2
    for p, m in zip(both, (first, second)):
        p.check_valid(m.num_layers, "train")
        assert len(p.fwd_plan) + len(p.bwd_plan) >= 2


def test_a_parameter_in_two_live_roundpipes_is_an_error():
    shared = torch.nn.Linear(4, 4)
    first = RoundPipe(torch.nn.Sequential(shared, torch.nn.Tanh()), devices="sim:1")
    with pytest.raises(ValueError, match="already belongs to another live RoundPipe"):
        RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4), shared), devices="sim:1")
    del first
    import gc
    gc.collect()
    RoundPipe(torch.nn.Sequential(shared), devices="sim:1")  # free once the first is gone


class _Transposed(torch.nn.Module):
    def forward(self, x, scale=1.0):
        return x.t() * scale


class _WithCount(torch.nn.Module):
    def forward(self, h):
        return h, torch.tensor(float(h.shape[0]), device=h.device)  # (a layer makes its tensors where it runs)


def test_the_originals_split_and_merge_specs(devices):
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(_Transposed(), lin, _WithCount())
    plain = copy.deepcopy(lin)
    x = torch.randn(4, 6)  # the batch is dim 1
    expected = plain(x.t() * 0.5)
    config = RoundPipeRunConfig(
        num_microbatch=2,
        split_input=((TensorChunkSpec(1),), {"scale": _Replicate}),
        merge_output=(TensorChunkSpec(0), _CustomReducer(torch.tensor(0.0), lambda a, b: a + b)))
    pipe = RoundPipe(model, devices=devices)
    with torch.no_grad():
        out, count = pipe(x, scale=0.5, roundpipe_run_config=config)
    assert_close(out, expected)
    assert count.item() == 6.0  # summed, not averaged

    # The original's split_input function format: (args_list, kwargs_list).
    def split(args, kwargs, n):
        parts = torch.tensor_split(args[0], n, 1)
        return [(p,) for p in parts], [dict(kwargs) for _ in parts]

    with torch.no_grad():
        out, _ = pipe(x, scale=0.5, roundpipe_run_config=RoundPipeRunConfig(
            num_microbatch=3, split_input=split, merge_output=(TensorChunkSpec(0), _Replicate)))
    assert_close(out, expected)

    # split_label as a spec tree: the target split, the weight replicated.
    seq = torch.nn.Sequential(torch.nn.Linear(4, 3))
    plain_seq = copy.deepcopy(seq)
    pipe2 = RoundPipe(seq, devices=devices)
    xs, ys = torch.randn(6, 4), torch.randn(6, 3)
    loss = pipe2.forward_backward(
        input_args=(xs,), label=(ys, 2.0), loss_fn=lambda o, lbl: mse(o, lbl[0]) * lbl[1],
        run_config=RoundPipeRunConfig(num_microbatch=2, split_label=(TensorChunkSpec(0), _Replicate)))
    pipe2.synchronize()
    expected_loss = sum(mse(plain_seq(a), b) * 2.0 for a, b in zip(xs.chunk(2), ys.chunk(2)))
    expected_loss.backward()
    assert_close(loss, expected_loss)
    for p, q in zip(seq.parameters(), plain_seq.parameters()):
        assert_close(p.grad, q.grad)
    with pytest.raises(TypeError, match="split_label"):
        RoundPipeRunConfig(split_label=3)


def test_a_custom_merge_is_differentiated_through(devices):
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    plain = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=devices)
    x = torch.randn(6, 4, requires_grad=True)
    xp = x.detach().clone().requires_grad_(True)
    for merge, plain_merge in [
            (lambda outs: torch.cat(outs) * 2.0, lambda outs: torch.cat(outs) * 2.0),
            (TensorChunkSpec(0), None)]:
        config = RoundPipeRunConfig(num_microbatch=2, merge_output=merge)
        out = pipe(x, roundpipe_run_config=config)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        parts = [plain(p) for p in xp.chunk(2)]
        ref = plain_merge(parts) if plain_merge else torch.cat(parts)
        ref.square().sum().backward()
        assert_close(out, ref)
    pipe.synchronize()
    assert_close(x.grad, xp.grad)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


def test_the_timer_switch_logs_the_measured_layers(capfd):
    from roundpipe.timer import ModelTimer

    assert ModelTimer.VERBOSE is False and ModelTimer.SMOOTH_RATE == 0.9
    ModelTimer.VERBOSE = True
    try:
        pipe = RoundPipe(make_model(), devices="sim:1")
    finally:
        ModelTimer.VERBOSE = False
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    for _ in range(4):
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    pipe.synchronize()
    err = capfd.readouterr().err
    assert "plan for" in err and "forward" in err, err


def test_the_originals_import_paths():
    from roundpipe.batch import RoundPipePackedData
    from roundpipe.models import SUPPORTED_MODELS
    from roundpipe.roundpipe import AutoRoundPipe
    from roundpipe.timer import ModelTimer

    assert AutoRoundPipe is roundpipe.AutoRoundPipe
    assert RoundPipePackedData is roundpipe.PackedMicrobatches
    assert set(SUPPORTED_MODELS) >= {"Qwen3ForCausalLM", "LlamaForCausalLM"}
    assert ModelTimer.SMOOTH_RATE == 0.9


def test_a_loss_fn_returning_a_sequence_backpropagates_their_sum_and_returns_each_sum(devices):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    plain = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def two_losses(out, label):
        return [torch.nn.functional.mse_loss(out, label), out.abs().mean()]

    losses = pipe.forward_backward(input_args=(x,), label=y, loss_fn=two_losses)
    pipe.synchronize()
    assert isinstance(losses, list) and len(losses) == 2
    expected = [sum(f(plain(a), b) for a, b in zip(x.chunk(2), y.chunk(2)))
                for f in (torch.nn.functional.mse_loss, lambda o, _: o.abs().mean())]
    (expected[0] + expected[1]).backward()
    for got, want in zip(losses, expected):
        assert_close(got, want.detach(), 1e-5)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, 1e-5)

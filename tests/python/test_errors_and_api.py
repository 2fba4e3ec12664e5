"""Errors raised in layers and loss functions, bad input, attribute
pass-through, OptimizerCtx, recompute helpers, and GradScaler."""
import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import (ModelExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig, StageError,
                       doing_recompute, get_recompute_data, save_for_recompute)

from conftest import ADAM_EPS, assert_adam_weights_close, assert_close, make_model, mse


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.armed = False

    def forward(self, x):
        if self.armed and x.shape[0] < 3:  # only the last microbatch (of 2 rows)
            raise ValueError("bad row count")
        return self.lin(x)


def test_layer_error_reaches_caller_with_context(devices):
    model = nn.Sequential(nn.Linear(4, 4), Fails(), nn.Linear(4, 2))
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x = torch.randn(8, 4)  # microbatches of 3, 3, 2
    model[1].armed = True
    with pytest.raises(StageError) as info:
        pipe.forward_backward(input_args=(x,), label=torch.randn(8, 2), loss_fn=mse)
    e = info.value
    assert e.layer == 1 and e.microbatch == 2 and e.phase == "forward"
    assert isinstance(e.__cause__, ValueError) and "bad row count" in str(e)
    assert "layer 1" in str(e) and e.device.startswith(devices.split(",")[0].split(":")[0])
    # the RoundPipe stays usable and kept no partial gradients
    model[1].armed = False
    assert all(p.grad is None for p in model.parameters())
    loss = pipe.forward_backward(input_args=(x,), label=torch.randn(8, 2), loss_fn=mse)
    assert torch.isfinite(loss)


def test_loss_fn_error_has_loss_phase(devices):
    pipe = RoundPipe(make_model(), devices=devices)

    def loss_fn(out, label):
        raise KeyError("no such label")

    with pytest.raises(StageError) as info:
        pipe.forward_backward(input_args=(torch.randn(4, 4),), label=None, loss_fn=loss_fn)
    assert info.value.phase == "loss" and isinstance(info.value.__cause__, KeyError)


def test_step_fn_error_reaches_caller(devices):
    pipe = RoundPipe(make_model(), devices=devices)
    pipe.forward_backward(input_args=(torch.randn(4, 4),), label=torch.randn(4, 3), loss_fn=mse)

    def step_fn():
        raise ArithmeticError("optimizer exploded")

    with pytest.raises(ArithmeticError, match="optimizer exploded"):
        pipe.step(step_fn, is_async=False)


class FailsInRecompute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.armed = False

    def forward(self, x):
        if self.armed and doing_recompute():
            raise ValueError("recompute failed")
        return self.lin(x)


def test_backward_error_through_autograd_is_reported_once(devices):
    model = nn.Sequential(nn.Linear(4, 4), FailsInRecompute(), nn.Linear(4, 2))
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(
        num_microbatch=2, execute_plan=ModelExecutePlan([range(0, 3)], [range(2, 3), range(0, 2)])))
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    model[1].armed = True
    loss = mse(pipe(x), y)
    with pytest.raises(RuntimeError, match="recompute failed"):  # autograd's own error type
        loss.backward()
    model[1].armed = False
    pipe.synchronize()  # reported once: not again here
    assert all(p.grad is None for p in model.parameters())
    mse(pipe(x), y).backward()
    pipe.synchronize()
    assert all(p.grad is not None for p in model.parameters())


def test_blocking_calls_inside_a_step_function_raise(devices):
    pipe = RoundPipe(make_model(), devices=devices)
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    with pytest.raises(RuntimeError, match="synchronize\\(\\) was called from inside this RoundPipe"):
        pipe.step(pipe.synchronize, is_async=False)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    with pytest.raises(RuntimeError, match="forward_backward\\(\\) was called from inside"):
        pipe.step(lambda: pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse),
                  is_async=False)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    pipe.step(pipe.synchronize, is_async=True)
    with pytest.raises(RuntimeError, match="synchronize\\(\\) was called from inside"):
        pipe.synchronize()
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)  # still usable
    pipe.synchronize()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="pin_model"):
        RoundPipe(make_model(), pin_model="always")
    with pytest.raises(ValueError, match="recompute_grain"):
        RoundPipeRunConfig(recompute_grain="block")
    with pytest.raises(ValueError, match="num_microbatch"):
        RoundPipeRunConfig(num_microbatch=0)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        RoundPipe(lambda x: x)
    pipe = RoundPipe(make_model(), devices="sim:1")
    with pytest.raises(RuntimeError, match="forward plan"):
        pipe(torch.randn(4, 4), roundpipe_run_config=RoundPipeRunConfig(
            execute_plan=ModelExecutePlan([range(0, 2)], [range(0, 6)])))
    with pytest.raises(RuntimeError, match="stays in CPU memory"):
        pipe.to("cuda")


def test_buffer_requiring_grad_is_rejected():
    m = nn.Linear(2, 2)
    m.register_buffer("b", torch.zeros(2, requires_grad=True))
    with pytest.raises(RuntimeError, match="buffer 'b' requires grad"):
        RoundPipe(m)


def test_attribute_pass_through():
    model = make_model()
    model.vocab_size = 11
    model.config = {"name": "tiny"}
    pipe = RoundPipe(model)
    assert pipe.vocab_size == 11 and pipe.config["name"] == "tiny"
    pipe.vocab_size = 12  # writes go to both
    assert model.vocab_size == 12 and pipe.vocab_size == 12
    assert pipe[0] is model[0]  # indexing the wrapped Sequential
    with pytest.raises(AttributeError):
        pipe.no_such_attribute
    pipe.eval()
    assert not model.training
    pipe.train()
    assert model.training


def test_optimizer_ctx_gives_masters():
    model = make_model(dtype=torch.bfloat16)
    pipe = RoundPipe(model, optim_dtype=torch.float32)
    assert all(p.dtype == torch.bfloat16 for p in pipe.parameters())
    with OptimizerCtx():
        params = list(pipe.parameters())
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    assert all(p.dtype == torch.float32 for p in params)
    assert [id(p) for p in params] == [id(p) for p in pipe.optim_parameters()]
    assert len(opt.param_groups[0]["params"]) == len(params)


class RandomRouting(nn.Module):
    """Random, host-syncing work that a recompute must replay, not redo."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.recomputes = 0

    def forward(self, x):
        if doing_recompute():
            (keep,) = get_recompute_data()
            type(self).seen_recompute = True
        else:
            keep = torch.randperm(x.shape[0], device=x.device)[: x.shape[0] // 2]
            save_for_recompute(keep)
        out = self.lin(x)
        return out.index_fill(0, keep, 0.0)


def test_recompute_helpers_replay_saved_data(devices):
    RandomRouting.seen_recompute = False
    model = nn.Sequential(RandomRouting(), nn.Linear(4, 4), nn.Linear(4, 1))
    pipe = RoundPipe(model, devices=devices,
                     model_run_config=RoundPipeRunConfig(preserve_rng_state=False, num_microbatch=1))
    x = torch.randn(6, 4)
    loss = pipe.forward_backward(input_args=(x,), label=None, loss_fn=lambda o, _: o.sum(),
                                 run_config=RoundPipeRunConfig(execute_plan=ModelExecutePlan(
                                     [range(0, 2)], [range(2, 3), range(0, 2)])))
    pipe.synchronize()
    assert RandomRouting.seen_recompute
    # the gradient of the zeroed rows' bias is consistent with the forward:
    # d(sum)/d(bias of layer 0) = (rows kept) * (W1^T W2^T), which needs the
    # same `keep` in forward and recompute
    w = model[2].weight @ model[1].weight
    kept_rows = 6 - 3
    assert_close(model[0].lin.bias.grad, (w.squeeze(0) * kept_rows).detach(), 1e-5)
    assert torch.isfinite(loss)


def test_grad_scaler_matches_unscaled_training():
    torch.manual_seed(0)
    model = make_model()
    pipe = RoundPipe(model)
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-2, eps=ADAM_EPS)  # see conftest
    scaler = roundpipe.GradScaler(init_scale=1024.0)
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    for _ in range(3):
        x, y = torch.randn(6, 4), torch.randn(6, 3)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)),
                              run_config=RoundPipeRunConfig(num_microbatch=1))
        pipe.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
        scaler.update()
        ref_opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
    pipe.synchronize()
    assert scaler.get_scale() == 1024.0
    for p, q in zip(model.parameters(), ref.parameters()):
        # 3 Adam steps on gradients that differ by rounding: 3 * lr * GRAD_ERROR / ADAM_EPS = 3e-4
        assert_adam_weights_close(p, q, steps=3, lr=1e-2)


def test_auto_plan_fits_a_memory_limit(capsys):
    model = make_model(dim=64, blocks=6)  # a block: ~33k floats = 130 KiB
    pipe = RoundPipe(model, devices="sim:2")
    block_bytes = sum(p.numel() * 4 for p in model[1].parameters())
    # A backward stage holds at most one block: one needs 3 blocks' bytes
    # (parameters, gradients, the next stage's parameters), two need 6, and
    # until activations are measured the plan keeps half the limit for them.
    limit_gib = 7 * block_bytes / 2**30
    plan = ModelExecutePlan.auto("fused", pipe, model_memory_limit=limit_gib, verbose=True)
    plan.validate(len(model), fused=True)
    # (layers 1..6 are the blocks; the embedding and head are small)
    assert all(sum(1 for layer in r if 1 <= layer <= 6) <= 1 for r in plan.bwd_plan[1:]), plan
    assert "predicted" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="smallest feasible limit"):
        ModelExecutePlan.auto("fused", pipe, model_memory_limit=limit_gib / 10)
    # a model-level limit is the default plan's
    limited = RoundPipe(make_model(dim=64, blocks=6), devices="sim:2", model_memory_limit=limit_gib)
    loss = limited.forward_backward(input_args=(torch.randn(6, 4),), label=torch.randn(6, 3), loss_fn=mse)
    assert torch.isfinite(loss)


def test_replicated_tail_plan_trains_like_one_device():
    # The whole model as one fused stage on two simulated devices, each
    # taking every other microbatch: the same loss and gradients as plain
    # PyTorch on the same microbatches.
    torch.manual_seed(0)
    model, oracle = make_model(dim=16, blocks=3), make_model(dim=16, blocks=3)
    oracle.load_state_dict(model.state_dict())
    pipe = RoundPipe(model, devices="sim:2")
    plan = ModelExecutePlan([], [range(0, len(model))], tail_replicas=2)
    assert "tail_replicas=2" in repr(plan)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse,
                                 run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=plan))
    pipe.synchronize()
    ref = sum(mse(oracle(xm), ym) for xm, ym in zip(x.chunk(4), y.chunk(4)))
    ref.backward()
    assert_close(loss, ref.detach(), 1e-5)
    for p, q in zip(model.parameters(), oracle.parameters()):
        assert_close(p.grad, q.grad, 1e-5)
    with pytest.raises(RuntimeError, match="tail_replicas"):
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=RoundPipeRunConfig(
            num_microbatch=4, execute_plan=ModelExecutePlan([range(0, 1)], [range(1, len(model)), range(0, 1)],
                                                            tail_replicas=2)))


def test_grad_scaler_clipping_recipe_and_the_original_api():
    """The documented recipe: unscale_ in the step function, clip, then
    step; against plain PyTorch with the same clipping. And the rest of the
    original's GradScaler: step returns optimizer.step's result, scale takes
    a list, update(new_scale), update(is_async=False), getters and setters."""
    torch.manual_seed(0)
    model = make_model()
    pipe = RoundPipe(model)
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-2, eps=ADAM_EPS)
    scaler = roundpipe.GradScaler(init_scale=1024.0)
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    results = []

    def step_fn():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(list(pipe.optim_parameters()), 0.05)
        results.append(scaler.step(opt))
        opt.zero_grad()

    for _ in range(3):
        x, y = torch.randn(6, 4), torch.randn(6, 3)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)),
                              run_config=RoundPipeRunConfig(num_microbatch=1))
        pipe.step(step_fn, is_async=False)
        scaler.update()
        ref_opt.zero_grad()
        mse(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
        ref_opt.step()
    pipe.synchronize()
    assert results == [None, None, None]  # Adam.step() returns None
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_adam_weights_close(p, q, steps=3, lr=1e-2)

    # unscale_ outside the step function, or twice in one step, is an error
    # naming the rule.
    with pytest.raises(RuntimeError, match="inside the step function"):
        scaler.unscale_(opt)
    errors = []

    def twice():
        try:
            scaler.unscale_(opt)
            scaler.unscale_(opt)
        except RuntimeError as e:
            errors.append(str(e))
        scaler.step(opt)

    pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)))
    pipe.step(twice, is_async=False)
    scaler.update()
    assert len(errors) == 1 and "already been called in this step" in errors[0]

    s = roundpipe.GradScaler(init_scale=8.0, growth_interval=5)
    assert s.is_enabled() and not roundpipe.GradScaler(enabled=False).is_enabled()
    a, b = s.scale([torch.tensor(1.0), torch.tensor(2.0)])
    assert (a.item(), b.item()) == (8.0, 16.0)
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(7)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 7)
    # Step 0 overflows: a synchronous update backs off at once (8 x 0.25)...
    assert s._impl.step([torch.tensor([float("inf")])], lambda: None) is False
    s.update(is_async=False)
    assert s.get_scale() == 2.0
    # ... and the async update after step 1 does not apply that finding again.
    assert s._impl.step([torch.tensor([1.0])], lambda: None) is True
    s.update()
    assert s.get_scale() == 2.0
    assert s._impl.step([torch.tensor([1.0])], lambda: None) is True
    s.update(new_scale=torch.tensor(4.0))
    assert s.get_scale() == 4.0

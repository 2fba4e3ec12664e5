"""model.step(optimizer) with a roundpipe.optim.Adam (Note [A fused step from
Python]) trains as the original's step function lambda: (optimizer.step(),
optimizer.zero_grad()) does: the same losses, weights, masters, gradients
left in .grad and optimizer state, bit for bit, async and sync; with param
groups, AdamW, amsgrad, an LR schedule (which sees its optimizer step) and a
master the optimizer does not hold (its gradient stays in .grad, its weight
unchanged)."""
import warnings

import pytest
import roundpipe
import torch
from conftest import make_model
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


# Bit for bit needs the same gradients in both runs, so one plan: the
# automatic one follows measured times and may differ between two runs (a
# replicated tail sums a call's float16 gradients in another order).
PINNED = RoundPipeRunConfig(execute_plan=ModelExecutePlan([range(0, 4)], [range(4, 6), range(2, 4), range(0, 2)]))


def train(devices, fused, is_async, make_optimizer, steps=4, schedule=False):
    torch.manual_seed(0)
    model = make_model(dtype=torch.float16)
    pipe = RoundPipe(model, devices=devices, optim_dtype=torch.float32, model_run_config=PINNED)
    masters = list(pipe.optim_parameters())
    optimizer = make_optimizer(masters)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if schedule else None
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=data).half(), torch.randn(6, 3, generator=data).half()
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = pipe.forward_backward(input_args=(x,), label=y,
                                         loss_fn=lambda o, t: ((o - t) ** 2).float().mean())
            losses.append(float(loss))
            if fused:
                pipe.step(optimizer, is_async=is_async)
            else:
                pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=is_async)
            if scheduler is not None:
                scheduler.step()
        pipe.synchronize()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]
    return {
        "losses": losses,
        "weights": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in masters],
        "grads": [None if m.grad is None else m.grad.clone() for m in masters],
        "state": optimizer.state_dict(),
    }


def assert_same(fused, plain):
    assert fused["losses"] == plain["losses"]
    for kind in ("weights", "masters"):
        for a, b in zip(fused[kind], plain[kind]):
            assert torch.equal(a, b), kind
    for a, b in zip(fused["grads"], plain["grads"]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert fused["state"]["param_groups"] == plain["state"]["param_groups"]
    for key, state in plain["state"]["state"].items():
        for name, value in state.items():
            assert torch.equal(fused["state"]["state"][key][name], value), name


@pytest.mark.parametrize("devices", ["sim:1", "sim:2"])
@pytest.mark.parametrize("is_async", [True, False])
def test_a_fused_step_is_the_step_function_bit_for_bit(devices, is_async):
    def adam(masters):
        return roundpipe.optim.Adam(masters, lr=1e-2)

    fused = train(devices, True, is_async, adam)
    assert_same(fused, train(devices, False, is_async, adam))
    assert fused["losses"][-1] < fused["losses"][0]  # it trains (one batch, again and again)
    assert all(g is None for g in fused["grads"])  # zero_grad() after the step


def test_groups_adamw_amsgrad_a_schedule_and_a_master_it_does_not_hold():
    def adamw(masters):
        # The last master (the head's bias) in no group.
        return roundpipe.optim.AdamW([{"params": masters[:4], "weight_decay": 0.0},
                                      {"params": masters[4:-1]}], lr=1e-2, amsgrad=True)

    fused = train("sim:2", True, False, adamw, schedule=True)
    assert_same(fused, train("sim:2", False, False, adamw, schedule=True))
    assert fused["grads"][-1] is not None and fused["grads"][-1].abs().sum() > 0
    torch.manual_seed(0)
    start = make_model(dtype=torch.float16)  # the same seed: the starting weights
    assert torch.equal(fused["weights"][-1], list(start.parameters())[-1])
    assert fused["state"]["param_groups"][0]["lr"] == pytest.approx(1e-2 * 0.5 ** 2)


@pytest.mark.parametrize("is_async", [True, False])
def test_a_failing_update_reaches_the_caller_and_the_weights_are_the_masters(monkeypatch, is_async):
    """An update that fails inside the pass: the error reaches the caller,
    and each weight is its master as the failure left it, never a staging
    copy the pass did not write (async: there the one before the last)."""
    torch.manual_seed(0)
    model = make_model(dtype=torch.float16)
    pipe = RoundPipe(model, devices="sim:1", optim_dtype=torch.float32)
    masters = list(pipe.optim_parameters())
    optimizer = roundpipe.optim.Adam(masters, lr=1e-2)
    x, y = torch.randn(6, 4).half(), torch.randn(6, 3).half()

    def call():
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).float().mean())

    call()
    pipe.step(optimizer, is_async=is_async)
    # An async step runs on the optimizer thread: it must have read the real
    # _C before the patch, or this first update is the one that fails (at the
    # next call, outside the check below).
    pipe.synchronize()

    class Failing:
        def __getattr__(self, name):
            return getattr(roundpipe._C, name)

        def adam_update(self, *args, **kwargs):
            raise ValueError("update failed")

    monkeypatch.setattr(roundpipe.optim, "_C", Failing())
    call()
    with pytest.raises(Exception, match="update failed"):
        pipe.step(optimizer, is_async=is_async)
        pipe.synchronize()
    monkeypatch.undo()
    pipe.synchronize()
    for weight, master in zip(model.parameters(), masters):
        assert torch.equal(weight, master.half())
    with pytest.raises(TypeError, match="no further arguments"):
        pipe.step(optimizer, True, 1)


def test_an_optimizer_whose_hooks_read_gradients_steps_as_the_lambda():
    """A step hook (or a subclass's step, or GradScaler.unscale_ asked for
    outside) may read .grad: such an optimizer takes the step function's
    path, and its hook sees the gradients."""
    seen = []

    def adam(masters):
        optimizer = roundpipe.optim.Adam(masters, lr=1e-2)
        optimizer.register_step_pre_hook(
            lambda opt, *_: seen.append(all(p.grad is not None for p in opt.param_groups[0]["params"])))
        return optimizer

    given = train("sim:1", True, True, adam)
    assert seen and all(seen)
    assert_same(given, train("sim:1", False, True, adam))


def test_another_optimizer_given_to_step_steps_as_the_lambda():
    def sgd(masters):
        return torch.optim.SGD(masters, lr=1e-2, momentum=0.9)

    given = train("sim:2", True, True, sgd)
    assert_same(given, train("sim:2", False, True, sgd))
    assert given["losses"][-1] < given["losses"][0]

"""The original's GradScaler API page (docs/API/grad_scaler.en.md): its
example loop (a float16 model, float32 masters, loss_fn scaling the float
loss and dividing by num_microbatch); a step with inf/NaN gradients is
skipped and the scale backs off; growth_interval clean steps multiply it by
growth_factor; enabled=False (step calls optimizer.step, scale returns its
input, get_scale 1.0, update a no-op); update(new_scale) copies the value;
step's return value on the optimizer thread; the getters with up_to_date.
(The clipping recipe, unscale_ and the setters: test_grad_scaler.py.)

Tolerance of the float16 loss: each of the example's 3 layers rounds its
output to float16 (2^-11 relative to the largest) in ours and in the
float16 oracle, in another summation order or on another device (whose
products may also round their partial sums: counted twice), so outputs
differ by at most d = 8 such roundings of the largest output; a mean
squared error then moves by at most 2 d mean|out - label| + d^2."""
import copy

import pytest
import torch
import torch.nn as nn
from roundpipe import GradScaler, RoundPipe, RoundPipeRunConfig
from roundpipe.optim import Adam

FP16_ROUNDINGS = 8 * 2.0**-11


def my_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def test_the_pages_example_loop():
    my_model = my_net()
    plain = copy.deepcopy(my_model).to(torch.float16)  # the oracle: the same float16 weights
    criterion = nn.MSELoss()
    torch.manual_seed(1)
    dataloader = [(torch.randn(6, 4).half(), torch.randn(6, 3)) for _ in range(2)]

    scaler = GradScaler()
    model = RoundPipe(my_model.to(torch.float16), optim_dtype=torch.float32)
    optimizer = Adam(model.optim_parameters(), lr=1e-3)
    num_microbatch = len(model.devices) + 1  # the default
    initial = [p.detach().clone() for p in model.optim_parameters()]

    losses = []
    for data, labels in dataloader:
        loss = model.forward_backward(
            input_args=(data,),
            label=labels,
            loss_fn=lambda out, lbl: scaler.scale(
                criterion(out.float(), lbl)
            ) / num_microbatch,
        )
        model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))
        scaler.update()
        losses.append(loss.item() / scaler.get_scale())
    model.synchronize()

    # Both iterations ran on the initial weights (asynchronous steps: one
    # update old); the scale stays 2^16 while no gradient overflows.
    for (data, labels), loss in zip(dataloader, losses):
        with torch.no_grad():
            outs = [plain(a).float() for a in data.tensor_split(num_microbatch)]
        parts = labels.tensor_split(num_microbatch)
        expected = sum(criterion(o, b).item() for o, b in zip(outs, parts)) / num_microbatch
        d = FP16_ROUNDINGS * max(o.abs().max().item() for o in outs)
        tol = max(2 * d * (o - b).abs().mean().item() + d * d for o, b in zip(outs, parts))
        assert loss == pytest.approx(expected, abs=tol)
    assert scaler.get_scale() == 2.0**16
    # The updates reached the float32 masters, and the float16 model holds them.
    for p, m, m0 in zip(my_model.parameters(), model.optim_parameters(), initial):
        assert m.dtype == torch.float32 and p.dtype == torch.float16
        assert torch.equal(p, m.to(torch.float16))
        assert not torch.equal(m, m0)


def test_an_overflowing_step_is_skipped_and_the_scale_backs_off():
    my_model = my_net().to(torch.float16)
    model = RoundPipe(my_model, optim_dtype=torch.float32)
    optimizer = Adam(model.optim_parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=2.0**10, backoff_factor=0.25)
    x, y = torch.randn(6, 4).half(), torch.randn(6, 3)
    before = [p.detach().clone() for p in model.optim_parameters()]
    # 1e30 times the loss: its gradients overflow float16 (max 65504)
    model.forward_backward(input_args=(x,), label=y,
                           loss_fn=lambda out, lbl: scaler.scale(nn.functional.mse_loss(out.float(), lbl) * 1e30))
    model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()), is_async=False)
    scaler.update()
    for p, b in zip(model.optim_parameters(), before):
        assert torch.equal(p, b)  # skipped: the parameters are not corrupted
    for _ in range(2):  # then clean steps: one backoff, whether an update sees the latest step or the one before
        model.forward_backward(input_args=(x,), label=y,
                               loss_fn=lambda out, lbl: scaler.scale(nn.functional.mse_loss(out.float(), lbl)))
        model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))
        scaler.update()
    model.synchronize()
    assert scaler.get_scale() == 2.0**10 * 0.25
    assert all(torch.isfinite(p).all() for p in model.optim_parameters())


def test_growth_interval_clean_steps_multiply_the_scale_by_growth_factor():
    model = RoundPipe(my_net().to(torch.float16), optim_dtype=torch.float32)
    optimizer = Adam(model.optim_parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=4.0, growth_factor=3.0, growth_interval=2)
    assert (scaler.get_growth_factor(up_to_date=True), scaler.get_growth_interval(up_to_date=True),
            scaler.get_backoff_factor(up_to_date=True)) == (3.0, 2, 0.5)
    x, y = torch.randn(6, 4).half(), torch.randn(6, 3)
    for _ in range(5):
        model.forward_backward(input_args=(x,), label=y,
                               loss_fn=lambda out, lbl: scaler.scale(nn.functional.mse_loss(out.float(), lbl)))
        model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))
        scaler.update()
    model.synchronize()
    # 5 updates after clean steps: two full intervals of 2, whether an
    # update sees the latest step or (asynchronous) the one before it
    assert scaler.get_scale() == 4.0 * 3.0**2


def test_disabled_and_new_scale_and_the_step_return_value():
    scaler = GradScaler(enabled=False)
    t = torch.tensor(3.0)
    assert scaler.scale(t) is t or torch.equal(scaler.scale(t), t)  # returned unmodified
    assert scaler.get_scale() == 1.0
    w = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.5)
    w.grad = torch.tensor([1.0, float("inf")])
    assert scaler.step(optimizer, lambda: 7.0) == 7.0  # optimizer.step(closure) ran, whatever the gradients
    assert w[0].item() == 0.5
    scaler.update()
    assert scaler.get_scale() == 1.0

    # new_scale is copied: later changes to the tensor do not reach the scaler
    model = RoundPipe(my_net(), model_run_config=RoundPipeRunConfig(num_microbatch=1))
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    scaler = GradScaler(init_scale=2.0)
    new = torch.tensor(8.0)
    results = []
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    for k in range(3):
        model.forward_backward(input_args=(x,), label=y,
                               loss_fn=lambda out, lbl: scaler.scale(nn.functional.mse_loss(out, lbl)))
        # on the optimizer thread, step returns optimizer.step's return value
        model.step(lambda: (results.append(scaler.step(optimizer, lambda: 5.0)), optimizer.zero_grad()))
        scaler.update(new_scale=new if k == 0 else None)
        new.fill_(100.0)
    model.synchronize()
    assert results == [5.0, 5.0, 5.0]
    assert scaler.get_scale() == 8.0

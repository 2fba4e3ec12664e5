"""The original's runtime-context API page (docs/API/context.en.md):
save_for_recompute / doing_recompute / get_recompute_data (its MyLayer
example replays the forward's torch.nonzero mask in the recompute, once per
layer, a no-op without gradients, the data a tuple, AssertionError outside
a recompute) and OptimizerCtx (its two equivalent ways to build an
optimizer), against plain PyTorch.

Tolerances: fp32 on both sides, the same products summed in another order:
1e-5 relative (conftest's assert_close) on outputs and gradients."""
import copy

import pytest
import torch
import torch.nn as nn
from conftest import GRAD_ERROR, assert_close
from roundpipe import (
    RoundPipe,
    RoundPipeRunConfig,
    StageError,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)


class MyLayer(nn.Module):
    def forward(self, x):
        if doing_recompute():
            # Recomputation phase: use the saved mask directly
            mask, = get_recompute_data()
        else:
            # Forward pass phase: generate and save the mask
            mask = torch.nonzero(x)
            save_for_recompute(mask)
        return x, mask


class Head(nn.Module):
    """Uses the mask: the output depends on which entries were nonzero."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(8, 2)

    def forward(self, inputs):
        x, mask = inputs
        keep = torch.zeros_like(x)
        keep[mask[:, 0], mask[:, 1]] = 1.0
        return self.out(x * keep + keep)


def test_the_pages_mylayer_replays_the_forwards_mask_in_the_recompute():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), MyLayer(), Head())
    plain = copy.deepcopy(net)  # run plainly: no recompute, save_for_recompute does nothing
    phases = []
    net[2].register_forward_hook(lambda m, i, o: phases.append((doing_recompute(), o[1].cpu().clone())))
    model = RoundPipe(net)
    x = torch.randn(6, 4)
    out = model(x)
    out.square().sum().backward()
    model.synchronize()
    forward = [mask for recompute, mask in phases if not recompute]
    replayed = [mask for recompute, mask in phases if recompute]
    assert forward and len(replayed) == len(forward)  # every microbatch's forward recomputed
    assert sorted(map(torch.Tensor.tolist, replayed)) == sorted(map(torch.Tensor.tolist, forward))
    assert isinstance(doing_recompute(), bool) and doing_recompute() is False

    n = len(model.devices) + 1
    expected = torch.cat([plain(part) for part in x.tensor_split(n)])
    expected.square().sum().backward()
    assert_close(out.detach(), expected.detach())
    for p, q in zip(net.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


def test_the_saved_data_comes_back_as_a_tuple_and_only_in_a_recompute():
    got = []

    class SavesOne(nn.Module):
        def forward(self, x):
            if doing_recompute():
                got.append(get_recompute_data())
            else:
                save_for_recompute(torch.ones(2))
            return x

    model = RoundPipe(nn.Sequential(nn.Linear(2, 2), SavesOne(), nn.Linear(2, 1)),
                      model_run_config=RoundPipeRunConfig(num_microbatch=1))
    model(torch.randn(3, 2)).sum().backward()
    model.synchronize()
    assert len(got) == 1 and isinstance(got[0], tuple) and len(got[0]) == 1
    assert torch.equal(got[0][0].cpu(), torch.ones(2))
    with pytest.raises(AssertionError):
        get_recompute_data()


def test_save_for_recompute_is_called_at_most_once_per_layers_forward():
    class SavesTwice(nn.Module):
        def forward(self, x):
            save_for_recompute(1)
            save_for_recompute(2)
            return x

    model = RoundPipe(nn.Sequential(nn.Linear(2, 2), SavesTwice(), nn.Linear(2, 1)))
    with pytest.raises(StageError, match="called twice"):
        model(torch.randn(4, 2)).sum().backward()
    model.synchronize()


def test_without_gradients_save_for_recompute_is_a_no_op():
    class SavesTwice(nn.Module):
        def forward(self, x):
            save_for_recompute(1)
            save_for_recompute(2)
            return x

    model = RoundPipe(nn.Sequential(nn.Linear(2, 2), SavesTwice(), nn.Linear(2, 1)))
    with torch.no_grad():
        model(torch.randn(4, 2))


def test_optimizer_ctx_and_optim_parameters_are_the_same_two_ways():
    from roundpipe import RoundPipe, OptimizerCtx
    from roundpipe.optim import Adam

    torch.manual_seed(0)
    my_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    plain = copy.deepcopy(my_model)
    model = RoundPipe(my_model)

    # Method 1: Using OptimizerCtx (recommended, consistent with PyTorch conventions)
    with OptimizerCtx():
        optimizer = Adam(model.parameters(), lr=0.001)
        named = [(n, id(p)) for n, p in model.named_parameters()]
    method1 = optimizer.param_groups[0]["params"]

    # Method 2: Using optim_parameters directly (equivalent)
    optimizer = Adam(model.optim_parameters(), lr=0.001)
    method2 = optimizer.param_groups[0]["params"]

    assert [id(p) for p in method1] == [id(p) for p in method2]
    assert named == [(n, id(p)) for n, p in model.optim_named_parameters()]
    assert [n for n, _ in named] == [n for n, _ in my_model.named_parameters()]

    # One step: Adam's first step moves each weight by lr * g / (|g| + eps),
    # at most lr, and by lr (to 1e-4 relative) against the sign of the plain
    # gradient wherever |g| > 1e-4 (far above the rounding of either side's
    # gradient, GRAD_ERROR); the new weight is rounded to fp32 (half an ulp,
    # at most 2^-24 of the largest weight, on each side of the difference).
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    loss_fn = nn.MSELoss()
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    model.synchronize()
    n = len(model.devices) + 1
    sum(loss_fn(plain(a), b) for a, b in zip(x.tensor_split(n), y.tensor_split(n))).backward()
    for p, q, master in zip(my_model.parameters(), plain.parameters(), method1):
        assert torch.equal(p.detach(), master.detach())
        moved = p.detach() - q.detach()
        rounding = 2 * 2.0**-24 * q.detach().abs().max().item()
        assert moved.abs().max() <= 0.001 + rounding
        sure = q.grad.abs() > max(1e-4, 10 * GRAD_ERROR)
        torch.testing.assert_close(moved[sure], -0.001 * q.grad[sure].sign(), rtol=1e-4, atol=rounding)

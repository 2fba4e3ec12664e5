"""The original's optimizer page: roundpipe.optim.Adam (the C++ kernel) against
torch.optim.Adam/AdamW with its full signature, OptimizerCtx,
optim_parameters / optim_named_parameters."""
import copy
import warnings

import pytest
import roundpipe
import torch
from conftest import make_model
from roundpipe import (
    OptimizerCtx,
    RoundPipe,
)


def test_optimizer_ctx_gives_masters():
    model = make_model(dtype=torch.bfloat16)
    pipe = RoundPipe(model, optim_dtype=torch.float32)
    # Outside the context: the model's parameters, with the original's
    # warning that an optimizer must not take them.
    with pytest.warns(UserWarning, match="OptimizerCtx"):
        assert all(p.dtype == torch.bfloat16 for p in pipe.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with OptimizerCtx():
            params = list(pipe.parameters())
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    assert all(p.dtype == torch.float32 for p in params)
    assert [id(p) for p in params] == [id(p) for p in pipe.optim_parameters()]
    assert len(opt.param_groups[0]["params"]) == len(params)


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


CONFIGS = [
    dict(),
    dict(weight_decay=0.1),
    dict(amsgrad=True),
    dict(maximize=True, betas=(0.8, 0.99)),
    dict(weight_decay=0.05, decoupled_weight_decay=True),
]


def run(opt_cls, params, steps, grads, **kw):
    opt = opt_cls(params, **kw)
    for k in range(steps):
        for p, g in zip(params, grads[k]):
            p.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize("config", CONFIGS)
def test_matches_torch_adam(config):
    torch.manual_seed(0)
    shapes = [(33, 17), (1000,), (3, 4, 5), ()]
    ours = [torch.randn(s) for s in shapes]
    theirs = [p.clone() for p in ours]
    grads = [[torch.randn(s) for s in shapes] for _ in range(6)]
    kw = dict(lr=1e-2, **config)
    run(roundpipe.optim.Adam, ours, 6, grads, **kw)
    decoupled = kw.pop("decoupled_weight_decay", False)
    run(torch.optim.AdamW if decoupled else torch.optim.Adam, theirs, 6, grads, **kw)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_param_groups_schedulers_and_state_dict():
    torch.manual_seed(1)
    a = [torch.randn(10, requires_grad=True), torch.randn(5, requires_grad=True)]
    b = [p.detach().clone().requires_grad_(True) for p in a]
    ours = roundpipe.optim.Adam([{"params": [a[0]], "lr": 0.1}, {"params": [a[1]]}], lr=0.01)
    theirs = torch.optim.Adam([{"params": [b[0]], "lr": 0.1}, {"params": [b[1]]}], lr=0.01)
    sched_ours = torch.optim.lr_scheduler.StepLR(ours, step_size=1, gamma=0.5)
    sched_theirs = torch.optim.lr_scheduler.StepLR(theirs, step_size=1, gamma=0.5)
    for step in range(4):
        g = [torch.randn(10), torch.randn(5)]
        for p, q, gi in zip(a, b, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        ours.step()
        theirs.step()
        sched_ours.step()
        sched_theirs.step()
        if step == 1:  # a checkpoint round trip mid-way
            state = copy.deepcopy(ours.state_dict())
            ours = roundpipe.optim.Adam([{"params": [a[0]], "lr": 0.1}, {"params": [a[1]]}], lr=0.01)
            ours.load_state_dict(state)
            sched_ours.optimizer = ours
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert int(ours.state[a[0]]["step"]) == 4


def test_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="learning rate"):
        roundpipe.optim.Adam([torch.zeros(1)], lr=-1)
    with pytest.raises(ValueError, match="betas"):
        roundpipe.optim.Adam([torch.zeros(1)], betas=(1.0, 0.9))

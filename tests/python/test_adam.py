"""roundpipe.optim.Adam (the C++ kernel) against torch.optim.Adam/AdamW."""
import copy

import pytest
import torch

import roundpipe

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

"""The original's optimizer API page (docs/API/optimizer.en.md): any PyTorch
optimizer steps a RoundPipe (fused=True recommended); roundpipe.optim.Adam
has the page's defaults, is a drop-in replacement for torch.optim.Adam, and
refuses sparse gradients. (Its full signature, every option against
torch.optim.Adam/AdamW, param groups and state dicts: test_optimizer.py.)

Tolerances: roundpipe.optim.Adam against torch.optim.Adam on the same
gradients: the same fp32 formula, a few ulps (1e-6, as test_optimizer.py);
trained weights: conftest's Adam bound at ADAM_EPS."""
import copy

import pytest
import roundpipe
import torch
import torch.nn as nn
from conftest import ADAM_EPS, assert_adam_weights_close
from roundpipe import RoundPipe, RoundPipeRunConfig


def test_the_defaults_of_the_signature():
    opt = roundpipe.optim.Adam([nn.Parameter(torch.zeros(2))])
    assert {k: opt.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                                         "decoupled_weight_decay")} == dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
        decoupled_weight_decay=False)


def test_a_drop_in_replacement_for_torch_adam():
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt, ref = roundpipe.optim.Adam(ours), torch.optim.Adam(theirs)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_sparse_gradients_are_refused():
    emb = nn.Embedding(5, 3, sparse=True)
    opt = roundpipe.optim.Adam(emb.parameters())
    emb(torch.tensor([1, 3])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_a_fused_pytorch_optimizer_steps_a_roundpipe():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    plain = copy.deepcopy(net)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=1))
    opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-2, eps=ADAM_EPS, fused=True)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=ADAM_EPS)
    for _ in range(3):
        x, y = torch.randn(6, 4), torch.randn(6, 3)
        model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        nn.functional.mse_loss(plain(x), y).backward()
        ref.step()
        ref.zero_grad()
    model.synchronize()
    for p, q in zip(net.parameters(), plain.parameters()):
        assert_adam_weights_close(p, q, steps=3, lr=1e-2)

"""The original's multi-GPU page: one process, the stages go round-robin
over every device (or, where the whole model fits, a fused tail replicated
over them); with num_microbatch fixed, training does not depend on
the device count (each compared with plain PyTorch on the same microbatch
split); the default num_microbatch is the number of devices + 1.

Tolerance: fp32 on both sides, the same products summed in another order:
1e-5 relative on losses, the Adam bound of conftest on weights."""
import pytest
import roundpipe
import torch
from conftest import ADAM_EPS, assert_adam_weights_close, assert_close, make_model, mse
from roundpipe import (
    ModelExecutePlan,
    RoundPipe,
    RoundPipeRunConfig,
)
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def test_a_fixed_num_microbatch_trains_the_same_on_any_device_count():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g)
    plain = make()
    ref_opt = torch.optim.Adam(plain.parameters(), lr=1e-2, eps=ADAM_EPS)
    expected = []
    for _ in range(3):
        loss = sum(nn.functional.mse_loss(plain(a), b) for a, b in zip(x.chunk(4), y.chunk(4)))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append(loss.detach())
    for devices in ("sim:1", "sim:2", "sim:3"):
        model = make()
        pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=4))
        assert len(pipe.devices) == int(devices[-1])
        opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-2, eps=ADAM_EPS)
        for step in range(3):
            loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            assert_close(loss, expected[step], 1e-5)
        pipe.synchronize()
        for p, q in zip(model.parameters(), plain.parameters()):
            assert_adam_weights_close(p, q, steps=3, lr=1e-2)


SEEN_ROWS = []


class RowRecorder(nn.Module):
    def forward(self, x):
        SEEN_ROWS.append(x.shape[0])
        return x


def test_the_default_num_microbatch_is_the_device_count_plus_one():
    for devices, n in (("sim:1", 2), ("sim:3", 4)):
        SEEN_ROWS.clear()
        pipe = RoundPipe(nn.Sequential(RowRecorder(), nn.Linear(8, 4)), devices=devices)
        with torch.no_grad():
            out = pipe(torch.randn(12, 8))
        assert out.shape == (12, 4)
        assert sorted(SEEN_ROWS) == [12 // n] * n, (devices, SEEN_ROWS)


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

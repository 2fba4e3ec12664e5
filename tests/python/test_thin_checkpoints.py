"""Thin checkpoints from Python (Note [Thin checkpoints], Note [Host room
for checkpoints]): a model of Python layers, which always run in layer
grain, switches to keeping each backward stage's input only once its layers
are measured and layer grain's checkpoints exceed host_checkpoint_limit;
the losses and gradients stay plain PyTorch's."""

import pytest
import torch
from conftest import mse
from roundpipe import RoundPipe, RoundPipeRunConfig
from torch import nn

DEVICE_LIMIT = 2e4  # bytes: a few layers' parameters, so several backward stages

def model():
    torch.manual_seed(4)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 2))

@pytest.mark.parametrize("limit,thin", [(1e-9, True), (64.0, False)])
def test_a_host_without_room_for_layer_grains_checkpoints_trains_the_same(limit, thin):
    ours, oracle = model(), model()
    pipe = RoundPipe(ours, devices="sim:1", model_memory_limit=DEVICE_LIMIT / 2**30, host_checkpoint_limit=limit,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = torch.randn(64, 16), torch.randn(64, 2)
    calls = 4
    for _ in range(calls):
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
        expected = sum(mse(oracle(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2)))
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    pipe.synchronize()
    for p, q in zip(ours.parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    count = pipe.pipeline_stats()["calls_with_thin_checkpoints"]
    # The first calls measure the layers in layer grain.
    assert (0 < count < calls) if thin else count == 0
    # The latest call's plan, as it ran: within the device limit it was made for.
    assert 0 < pipe.pipeline_stats()["last_call_planned_peak_bytes"] <= DEVICE_LIMIT

def test_a_non_positive_host_checkpoint_limit_is_refused():
    with pytest.raises(Exception, match="host_checkpoint_limit must be positive"):
        RoundPipe(model(), devices="sim:1", host_checkpoint_limit=0.0)

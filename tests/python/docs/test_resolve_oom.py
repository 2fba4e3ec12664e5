"""The original's "resolve out of memory" page, on a simulated card that
fails allocations past its budget as a GPU does: each remedy it lists (more
microbatches; recompute_grain="layer"; smaller stages by a hand-written plan
or a lower model_memory_limit; pin_model="register" or "off" for host
memory; gradient accumulation over several forward_backward calls before
one step) trains within the budget with plain PyTorch's numbers.

Tolerance: fp32 on both sides, microbatch sums in another order: 1e-5
relative on losses and gradients."""
import pytest
import torch
from conftest import assert_close
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from torch import nn

BUDGET = "sim:2,mem=600KiB"  # a single stage (parameters + gradients 544 KB + activations) does not fit


def make():
    torch.manual_seed(0)
    layers = [nn.Linear(16, 128), nn.Tanh()]
    for _ in range(4):
        layers += [nn.Linear(128, 128), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(128, 4))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)


def plain_grads(n):
    model = make()
    x, y = data()
    loss = sum(nn.functional.mse_loss(model(a), b) for a, b in zip(x.chunk(n), y.chunk(n)))
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


REMEDIES = {
    "more microbatches": dict(config=dict(num_microbatch=8)),
    "layer grain": dict(config=dict(num_microbatch=4, recompute_grain="layer")),
    "a hand-written plan of small stages": dict(config=dict(num_microbatch=4), plan=True),
    "a lower model_memory_limit": dict(config=dict(num_microbatch=4), kwargs=dict(model_memory_limit=0.001)),
    "pin_model=register": dict(config=dict(num_microbatch=4), kwargs=dict(pin_model="register")),
    "pin_model=off": dict(config=dict(num_microbatch=4), kwargs=dict(pin_model="off")),
}


@pytest.mark.parametrize("remedy", sorted(REMEDIES))
def test_each_remedy_trains_within_the_budget_like_plain_pytorch(remedy):
    spec = REMEDIES[remedy]
    config = RoundPipeRunConfig(**spec["config"])
    model = make()
    pipe = RoundPipe(model, devices=BUDGET, model_run_config=config, **spec.get("kwargs", {}))
    if spec.get("plan"):
        plan = ModelExecutePlan()
        plan.fwd_plan = [range(0, 4), range(4, 8)]
        plan.bwd_plan = [range(8, 11), range(6, 8), range(3, 6), range(0, 3)]
        config.execute_plan = plan
    x, y = data()
    for _ in range(2):  # the second call runs on the plan made from measurements
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
    pipe.synchronize()
    expected, grads = plain_grads(config.num_microbatch)
    assert_close(loss, expected, 1e-5)
    for p, g in zip(model.parameters(), grads):
        assert_close(p.grad, 2 * g, 1e-5)  # two calls accumulate
    for device in pipe._engine.devices:
        assert device.startswith("sim")


def test_gradient_accumulation_over_calls_equals_one_large_batch():
    """Fewer microbatches per call (activations live in host memory) and
    several forward_backward calls before one step: the accumulated
    gradients are the whole batch's."""
    model = make()
    pipe = RoundPipe(model, devices=BUDGET, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = data()
    total = 0
    for a, b in zip(x.chunk(4), y.chunk(4)):  # 4 calls of 16 rows, 2 microbatches each
        total = total + pipe.forward_backward(input_args=(a,), label=b, loss_fn=nn.functional.mse_loss)
    pipe.synchronize()
    expected, grads = plain_grads(8)
    assert_close(total, expected, 1e-5)
    for p, g in zip(model.parameters(), grads):
        assert_close(p.grad, g, 1e-5)

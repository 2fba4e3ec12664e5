"""Errors raised in layers and loss functions, bad input, attribute
pass-through, OptimizerCtx, recompute helpers, and GradScaler."""
import copy
import threading

import pytest
import torch
from conftest import make_model, mse
from roundpipe import (
    ModelExecutePlan,
    RoundPipe,
    RoundPipeRunConfig,
    StageError,
    doing_recompute,
)
from torch import nn


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


def test_an_out_of_memory_error_raised_in_python_is_recovered_from(devices):
    # A torch.OutOfMemoryError from Python code the engine runs (here the
    # loss function, as a loss over full logits raises it on a card) is an
    # out-of-memory error to the engine: the microbatch is retried or the
    # call redone (Note [Out-of-memory redo]), with plain PyTorch's results.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    raised, raised_lock = [], threading.Lock()

    def loss_fn(out, label):
        with raised_lock:  # (two devices' threads may run it at once)
            first = not raised
            raised.append(1)
        if first:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return mse(out, label)

    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    pipe.synchronize()
    expected = sum(mse(plain(a), b) for a, b in zip(x.chunk(2), y.chunk(2)))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert pipe.pipeline_stats()["out_of_memory_recoveries"] == 1


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



"""The original's model API page (docs/API/model.en.md): RoundPipe's
constructor (a Sequential split into its children, any other model one
layer; optim_dtype; the call-site name; pin_model), forward with a per-call
run config, forward_backward as the page's pseudo-code defines it,
optim_parameters, step (synchronous: the next iteration sees the update),
synchronize (accumulated .grad), wrap_model_to_roundpipe's return types and
error, set_original_model and attribute forwarding; against plain PyTorch.

Tolerances: fp32 on both sides, the same products summed in another order:
1e-5 relative (conftest's assert_close); SGD moves a weight by lr times a
gradient, so weights differ by at most lr * GRAD_ERROR per step (plus their
own fp32 rounding, < 1e-6)."""
import copy

import pytest
import torch
import torch.nn as nn
from conftest import GRAD_ERROR, assert_close
from roundpipe import AutoRoundPipe, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe


def net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


class NotSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_the_constructor():
    seq = net()
    model = RoundPipe(seq)
    assert model.num_layers == 3  # each child a layer
    assert model.name.startswith("test_api_model.py:")  # filename:line of the call site
    assert RoundPipe(NotSequential()).num_layers == 1  # any other model: one layer
    # optim_dtype: the model's dtype by default; float32 masters for a float16 model
    assert {p.dtype for p in RoundPipe(net(torch.bfloat16)).optim_parameters()} == {torch.bfloat16}
    half = RoundPipe(net(torch.float16), optim_dtype=torch.float32, name="half")
    masters = half.optim_parameters()
    assert iter(masters) is masters  # an iterator
    assert half.name == "half" and {p.dtype for p in masters} == {torch.float32}
    # model_run_config: the default of every call, a call's config overrides it
    rows = []
    configured = RoundPipe(net(), model_run_config=RoundPipeRunConfig(num_microbatch=3))
    configured.model[0].register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    with torch.no_grad():
        configured(torch.randn(6, 4))
        assert rows == [2, 2, 2]
        configured(torch.randn(6, 4), roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1))
        assert rows == [2, 2, 2, 6]


@pytest.mark.parametrize("pin_model", ["alloc", "off"])
def test_each_pin_model_trains_the_same(pin_model):
    seq = net()
    plain = copy.deepcopy(seq)
    model = RoundPipe(seq, pin_model=pin_model)
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
    model.synchronize()
    n = len(model.devices) + 1
    expected = sum(nn.functional.mse_loss(plain(a), b) for a, b in zip(x.tensor_split(n), y.tensor_split(n)))
    expected.backward()
    assert_close(loss, expected.detach())
    for p, q in zip(seq.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pin_model_register_on_cuda():
    seq = net()
    model = RoundPipe(seq, pin_model="register")
    x = torch.randn(6, 4)
    with torch.no_grad():
        assert_close(model(x), seq(x))


def test_forward_backward_is_the_pages_pseudo_code():
    """The page's definition: split inputs and labels, and per microbatch
    forward, loss_fn, torch.autograd.backward; return sum(losses) and the
    merged outputs."""
    seq = net()
    plain = copy.deepcopy(seq)
    model = RoundPipe(seq)
    x, y = torch.randn(7, 4), torch.randn(7, 3)
    scale = torch.tensor(0.5)

    def loss_fn(outputs, labels):
        return ((outputs - labels) ** 2).sum() * scale.to(outputs.device)

    config = RoundPipeRunConfig(num_microbatch=3)
    loss, outputs = model.forward_backward(input_args=(x,), input_kwargs={}, label=y, loss_fn=loss_fn,
                                           return_outputs=True, run_config=config)
    model.synchronize()

    # the pseudo-code, on the plain model (automatic split: dim 0, earlier chunks larger)
    losses, outs = [], []
    for input_mb, label_mb in zip(x.tensor_split(3), y.tensor_split(3)):
        output_mb = plain(input_mb)
        loss_mb = loss_fn(output_mb, label_mb)
        torch.autograd.backward(loss_mb)
        losses.append(loss_mb)
        outs.append(output_mb)
    assert_close(loss, sum(losses).detach())
    assert_close(outputs, torch.cat(outs).detach())
    for p, q in zip(seq.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)
    # return_outputs=False: the loss alone
    assert isinstance(model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn), torch.Tensor)
    model.synchronize()


def test_a_synchronous_step_is_seen_by_the_next_iteration_and_synchronize_gives_grads():
    seq = net()
    plain = copy.deepcopy(seq)
    model = RoundPipe(seq, model_run_config=RoundPipeRunConfig(num_microbatch=1))
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    mse = nn.functional.mse_loss
    data = [(torch.randn(6, 4), torch.randn(6, 3)) for _ in range(3)]
    for step, (x, y) in enumerate(data):
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        expected = mse(plain(x), y)
        expected.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        assert_close(loss, expected.detach())  # the latest weights, every iteration
    for p, q in zip(seq.parameters(), plain.parameters()):  # the model's own tensors, already
        torch.testing.assert_close(p, q, rtol=0, atol=3 * 0.1 * GRAD_ERROR + 1e-6)
    # Without a step, gradients accumulate over calls; synchronize() puts
    # them in the parameters' .grad.
    for x, y in data[:2]:
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
        mse(plain(x), y).backward()
    model.synchronize()
    for p, q in zip(seq.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


def test_wrap_model_to_roundpipe_return_types():
    assert isinstance(wrap_model_to_roundpipe(net()), RoundPipe)
    torch.manual_seed(0)
    other = NotSequential()
    plain = copy.deepcopy(other)
    auto = wrap_model_to_roundpipe(other, lower_threshold=0, upper_threshold=64)
    assert isinstance(auto, AutoRoundPipe) and not isinstance(auto, RoundPipe)
    with pytest.raises(AttributeError):
        auto.forward_backward  # noqa: B018 (an AutoRoundPipe cannot call forward_backward)
    with torch.no_grad():  # its forward still runs
        x = torch.randn(3, 4)
        assert_close(auto(x), plain(x))
    with pytest.raises(NotImplementedError):
        wrap_model_to_roundpipe(NotSequential(), use_sequential_preset=True)


def test_attribute_forwarding_and_set_original_model():
    seq = net()
    seq.note = "wrapped"
    model = RoundPipe(seq)
    assert model.note == "wrapped"  # read from the wrapped model
    model.note = "written"
    assert seq.note == "written"  # writes go to it
    del model.note
    assert not hasattr(seq, "note")  # and deletes
    original = nn.Module()
    original.vocab_size = 96
    model.set_original_model(original)
    assert model.vocab_size == 96  # now read from the original model
    model.vocab_size = 97
    assert original.vocab_size == 97

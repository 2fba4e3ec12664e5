"""The original's training-loop page (RoundPipe's forward, forward +
.backward(), forward_backward, step sync and async, synchronize, gradient
accumulation, mixed-precision masters, chained RoundPipes), against plain
PyTorch."""
import copy

import pytest
import roundpipe
import torch
from conftest import ADAM_EPS, assert_adam_weights_close, assert_close, make_model, mse
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


def test_step_passes_extra_arguments_to_the_step_function(devices):
    pipe = RoundPipe(make_model(), devices=devices)
    seen = []
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    pipe.step(lambda a, b=0: seen.append((a, b)), False, 3, b=4)
    pipe.synchronize()
    assert seen == [(3, 4)]


def test_a_loss_fn_returning_a_sequence_backpropagates_their_sum_and_returns_each_sum(devices):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    plain = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def two_losses(out, label):
        return [torch.nn.functional.mse_loss(out, label), out.abs().mean()]

    losses = pipe.forward_backward(input_args=(x,), label=y, loss_fn=two_losses)
    pipe.synchronize()
    assert isinstance(losses, list) and len(losses) == 2
    expected = [sum(f(plain(a), b) for a, b in zip(x.chunk(2), y.chunk(2)))
                for f in (torch.nn.functional.mse_loss, lambda o, _: o.abs().mean())]
    (expected[0] + expected[1]).backward()
    for got, want in zip(losses, expected):
        assert_close(got, want.detach(), 1e-5)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, 1e-5)
def batch(n=6):
    return torch.randn(n, 4), torch.randn(n, 3)


def test_inference_matches_plain(devices, model_pair):
    model, plain = model_pair
    pipe = RoundPipe(model, devices=devices)
    x, _ = batch()
    with torch.no_grad():
        out = pipe(x, scale=0.5)
        expected = plain[1:](plain[0](x, 0.5))
    assert out.device.type == "cpu"
    assert not out.requires_grad
    assert_close(out, expected)


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("num_microbatch", [1, 3, 4])
def test_forward_then_backward_matches_plain(devices, model_pair, grain, num_microbatch):
    model, plain = model_pair
    pipe = RoundPipe(model, devices=devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain))
    x, y = batch(7)
    x.requires_grad_(True)
    loss = mse(pipe(x), y)
    loss.backward()
    pipe.synchronize()

    xp = x.detach().clone().requires_grad_(True)
    expected = mse(plain(xp), y)
    expected.backward()
    assert_close(loss, expected)
    assert_close(x.grad, xp.grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None, name
        assert_close(p.grad, q.grad)


@pytest.mark.parametrize("plan", [None, "one_per_stage", "single"])
def test_forward_backward_matches_plain(devices, model_pair, plan):
    model, plain = model_pair
    n_layers = len(model)
    plans = {
        None: None,
        "one_per_stage": ModelExecutePlan([range(i, i + 1) for i in range(n_layers - 1)],
                                          [range(i, i + 1) for i in reversed(range(n_layers))]),
        "single": ModelExecutePlan([range(0, n_layers - 2)], [range(n_layers - 2, n_layers), range(0, n_layers - 2)]),
    }
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(execute_plan=plans[plan]))
    x, y = batch(6)
    loss, out = pipe.forward_backward(input_args=(x,), label=y,
                                      loss_fn=lambda o, t: ((o - t) ** 2).sum(), return_outputs=True)
    pipe.synchronize()
    out_plain = plain(x)
    expected = ((out_plain - y) ** 2).sum()
    expected.backward()
    assert_close(loss, expected)  # the sum of microbatch sums
    assert_close(out, out_plain.detach())
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


def test_gradients_accumulate_across_calls(devices, model_pair):
    model, plain = model_pair
    pipe = RoundPipe(model, devices=devices)
    for _ in range(3):
        x, y = batch()
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
        n = len(pipe.devices) + 1
        sizes = [6 // n + (1 if i < 6 % n else 0) for i in range(n)]
        start = 0
        for s in sizes:
            mse(plain(x[start:start + s]), y[start:start + s]).backward()
            start += s
    pipe.synchronize()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad, 1e-4)


def train(pipe_or_model, opt, steps, data, is_async=None, step_fn=None):
    losses = []
    for x, y in data[:steps]:
        if is_async is None:
            opt.zero_grad()
            loss = mse(pipe_or_model(x), y)
            loss.backward()
            opt.step()
        else:
            loss = pipe_or_model.forward_backward(input_args=(x,), label=y, loss_fn=mse,
                                                  run_config=RoundPipeRunConfig(num_microbatch=1))
            pipe_or_model.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", ["torch", "roundpipe"])
def test_sync_step_matches_plain_training(devices, model_pair, optimizer):
    model, plain = model_pair
    pipe = RoundPipe(model, devices=devices, optim_dtype=torch.float32)
    opt_cls = torch.optim.Adam if optimizer == "torch" else roundpipe.optim.Adam
    opt = opt_cls(pipe.optim_parameters(), lr=1e-2, eps=ADAM_EPS)  # see conftest
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2, eps=ADAM_EPS)
    data = [batch()] * 5  # one batch, so the loss must fall
    ours = train(pipe, opt, 5, data, is_async=False)
    theirs = train(plain, plain_opt, 5, data)
    assert_close(torch.tensor(ours), torch.tensor(theirs), 1e-5)
    assert theirs[-1] < theirs[0]
    pipe.synchronize()
    for p, q in zip(model.parameters(), plain.parameters()):
        # 5 Adam steps on gradients that differ by rounding: 5 * lr * GRAD_ERROR / ADAM_EPS = 5e-4
        assert_adam_weights_close(p, q, steps=5, lr=1e-2)


def test_async_step_is_exactly_one_step_stale(devices, model_pair):
    model, plain = model_pair
    pipe = RoundPipe(model, devices=devices)
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-2, eps=ADAM_EPS)  # see conftest
    data = [batch() for _ in range(5)]
    ours = train(pipe, opt, 5, data, is_async=True)
    pipe.synchronize()

    # Oracle: iteration k computes gradients on the weights after k-1 updates
    # (one update old), and the updates apply in order.
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2, eps=ADAM_EPS)
    weights = [copy.deepcopy(plain.state_dict())]  # weights[v]: after v updates
    expected = []
    for k, (x, y) in enumerate(data):
        reader = make_model()
        reader.load_state_dict(weights[max(k - 1, 0)])
        loss = mse(reader(x), y)
        loss.backward()
        expected.append(float(loss))
        for p, r in zip(plain.parameters(), reader.parameters()):
            p.grad = r.grad.clone()
        plain_opt.step()
        plain_opt.zero_grad()
        weights.append(copy.deepcopy(plain.state_dict()))
    assert_close(torch.tensor(ours), torch.tensor(expected), 1e-5)
    for p, q in zip(model.parameters(), plain.parameters()):
        # 5 Adam steps on gradients that differ by rounding: 5 * lr * GRAD_ERROR / ADAM_EPS = 5e-4
        assert_adam_weights_close(p, q, steps=5, lr=1e-2)


def test_mixed_precision_masters(devices):
    model = make_model(dtype=torch.bfloat16)
    pipe = RoundPipe(model, devices=devices, optim_dtype=torch.float32)
    masters = pipe.optim_parameters()
    assert next(masters) is not None  # an iterator, as the original's (issue 32)
    masters = list(pipe.optim_parameters())
    assert all(m.dtype == torch.float32 for m in masters)
    assert len(masters) == len(list(model.parameters()))
    names = [n for n, _ in pipe.optim_named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    opt = roundpipe.optim.Adam(masters, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch()
    pipe.forward_backward(input_args=(x.bfloat16(),), label=y.bfloat16(), loss_fn=mse)
    pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    for p, b, m in zip(model.parameters(), before, masters):
        assert not torch.equal(p, b)
        assert torch.equal(p, m.to(torch.bfloat16))


def test_dropout_is_plan_independent(devices):
    torch.manual_seed(3)
    def build():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 32),
                                   torch.nn.Dropout(0.5), torch.nn.Linear(32, 3))
    x, y = batch(8)
    grads = []
    for plan in (None, ModelExecutePlan([range(0, 1), range(1, 2), range(2, 3), range(3, 4)],
                                        [range(4, 5), range(2, 4), range(0, 2)])):
        model = build()
        pipe = RoundPipe(model, devices=devices)
        torch.manual_seed(11)
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse,
                              run_config=RoundPipeRunConfig(execute_plan=plan, num_microbatch=2))
        pipe.synchronize()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert_close(a, b)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_chained_roundpipes_train_like_the_whole_model(devices):
    """As the original's: forward_backward sends its inputs' gradients
    upstream before returning, so an encoder RoundPipe feeding a decoder
    RoundPipe trains end to end (a model in two parts)."""
    torch.manual_seed(3)
    encoder = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    decoder = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    plain_encoder, plain_decoder = copy.deepcopy(encoder), copy.deepcopy(decoder)
    config = RoundPipeRunConfig(num_microbatch=2)
    first = RoundPipe(encoder, devices=devices, model_run_config=config)
    second = RoundPipe(decoder, devices=devices, model_run_config=config)
    x, y = batch(6)
    x.requires_grad_(True)
    loss = second.forward_backward(first(x), label=y, loss_fn=mse)
    assert x.grad is not None, "the input's gradient did not arrive before the return"
    first.synchronize()
    second.synchronize()

    xp = x.detach().clone().requires_grad_(True)
    hidden = plain_encoder(xp)
    expected = sum(mse(plain_decoder(h), t) for h, t in zip(hidden.chunk(2), y.chunk(2)))
    expected.backward()
    assert_close(loss, expected)
    assert_close(x.grad, xp.grad)
    for ours, plain in [(encoder, plain_encoder), (decoder, plain_decoder)]:
        for p, q in zip(ours.parameters(), plain.parameters()):
            assert_close(p.grad, q.grad)


def test_what_the_call_semantics_refuse(devices):
    """forward with requires_grad=True while autograd is off is a
    RuntimeError; forward_backward's loss is a detached CPU tensor and its
    outputs carry no grad."""
    pipe = RoundPipe(make_model(), devices=devices)
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    with torch.no_grad(), pytest.raises(RuntimeError, match="autograd is off"):
        pipe(x, roundpipe_run_config=RoundPipeRunConfig(requires_grad=True))
    loss, out = pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse, return_outputs=True)
    assert loss.device.type == "cpu" and not loss.requires_grad
    assert not out.requires_grad
    pipe.synchronize()


def test_autograd_grad_and_backward_inputs_are_refused_as_with_reentrant_checkpointing(devices):
    """The backward stages accumulate every parameter's gradient, which
    torch.autograd.grad() and backward(inputs=...) would not expect: both
    raise RuntimeError (as the original's), and a plain .backward() after
    them still works."""
    model = make_model()
    pipe = RoundPipe(model, devices=devices)
    x = torch.randn(6, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="autograd.grad"):
        torch.autograd.grad(pipe(x).sum(), x)
    with pytest.raises(RuntimeError, match="autograd.grad"):
        pipe(x).sum().backward(inputs=[x])
    pipe.synchronize()
    assert all(p.grad is None for p in model.parameters())
    pipe(x).sum().backward()
    pipe.synchronize()
    assert all(p.grad is not None for p in model.parameters())

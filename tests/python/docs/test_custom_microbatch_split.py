"""The original's custom-microbatch-split page: the automatic split (uneven,
replicated leaves), split_input / split_label / merge_output as functions
and as torch.distributed.pipelining specs, packed outputs feeding a next
RoundPipe, and errors."""
import copy

import pytest
import torch
from conftest import assert_close, mse
from roundpipe import PackedMicrobatches, RoundPipe, RoundPipeRunConfig
from torch import nn


class _Transposed(torch.nn.Module):
    def forward(self, x, scale=1.0):
        return x.t() * scale


class _WithCount(torch.nn.Module):
    def forward(self, h):
        return h, torch.tensor(float(h.shape[0]), device=h.device)  # (a layer makes its tensors where it runs)


def test_the_originals_split_and_merge_specs(devices):
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(_Transposed(), lin, _WithCount())
    plain = copy.deepcopy(lin)
    x = torch.randn(4, 6)  # the batch is dim 1
    expected = plain(x.t() * 0.5)
    config = RoundPipeRunConfig(
        num_microbatch=2,
        split_input=((TensorChunkSpec(1),), {"scale": _Replicate}),
        merge_output=(TensorChunkSpec(0), _CustomReducer(torch.tensor(0.0), lambda a, b: a + b)))
    pipe = RoundPipe(model, devices=devices)
    with torch.no_grad():
        out, count = pipe(x, scale=0.5, roundpipe_run_config=config)
    assert_close(out, expected)
    assert count.item() == 6.0  # summed, not averaged

    # The original's split_input function format: (args_list, kwargs_list).
    def split(args, kwargs, n):
        parts = torch.tensor_split(args[0], n, 1)
        return [(p,) for p in parts], [dict(kwargs) for _ in parts]

    with torch.no_grad():
        out, _ = pipe(x, scale=0.5, roundpipe_run_config=RoundPipeRunConfig(
            num_microbatch=3, split_input=split, merge_output=(TensorChunkSpec(0), _Replicate)))
    assert_close(out, expected)

    # split_label as a spec tree: the target split, the weight replicated.
    seq = torch.nn.Sequential(torch.nn.Linear(4, 3))
    plain_seq = copy.deepcopy(seq)
    pipe2 = RoundPipe(seq, devices=devices)
    xs, ys = torch.randn(6, 4), torch.randn(6, 3)
    loss = pipe2.forward_backward(
        input_args=(xs,), label=(ys, 2.0), loss_fn=lambda o, lbl: mse(o, lbl[0]) * lbl[1],
        run_config=RoundPipeRunConfig(num_microbatch=2, split_label=(TensorChunkSpec(0), _Replicate)))
    pipe2.synchronize()
    expected_loss = sum(mse(plain_seq(a), b) * 2.0 for a, b in zip(xs.chunk(2), ys.chunk(2)))
    expected_loss.backward()
    assert_close(loss, expected_loss)
    for p, q in zip(seq.parameters(), plain_seq.parameters()):
        assert_close(p.grad, q.grad)
    with pytest.raises(TypeError, match="split_label"):
        RoundPipeRunConfig(split_label=3)


def test_a_custom_merge_is_differentiated_through(devices):
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    plain = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=devices)
    x = torch.randn(6, 4, requires_grad=True)
    xp = x.detach().clone().requires_grad_(True)
    for merge, plain_merge in [
            (lambda outs: torch.cat(outs) * 2.0, lambda outs: torch.cat(outs) * 2.0),
            (TensorChunkSpec(0), None)]:
        config = RoundPipeRunConfig(num_microbatch=2, merge_output=merge)
        out = pipe(x, roundpipe_run_config=config)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        parts = [plain(p) for p in xp.chunk(2)]
        ref = plain_merge(parts) if plain_merge else torch.cat(parts)
        ref.square().sum().backward()
        assert_close(out, ref)
    pipe.synchronize()
    assert_close(x.grad, xp.grad)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


def test_uneven_split_and_replication(devices):
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x, other, scalar):
            seen.append((x.shape[0], other.shape[0], scalar))
            return x * self.w

    pipe = RoundPipe(Probe(), devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with torch.no_grad():
        out = pipe(torch.arange(8.0).view(8, 1), torch.zeros(5), 7)
    assert sorted(seen) == sorted([(3, 5, 7), (3, 5, 7), (2, 5, 7)])  # earlier chunks larger; others replicated
    assert_close(out, torch.arange(8.0).view(8, 1))


def test_a_batch_smaller_than_num_microbatch_is_one_microbatch_a_row(devices):
    """Issue 32, as the original (torch's pipelining splitter): 2 rows with
    num_microbatch=4 run as 2 microbatches, in forward and in training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    x, y = torch.randn(2, 2), torch.randn(2, 2)
    with torch.no_grad():
        assert_close(pipe(x), model(x))
    rows = []
    loss = pipe.forward_backward(input_args=(x,), label=y,
                                 loss_fn=lambda o, t: (rows.append(o.shape[0]), ((o - t) ** 2).sum())[1])
    assert sorted(rows) == [1, 1]
    assert_close(loss, ((model(x) - y) ** 2).sum().detach())


def test_custom_split_and_merge(devices):
    model = nn.Sequential(nn.Linear(4, 4))
    calls = {}

    def split(args, kwargs, n):
        calls["split"] = n
        x, = args
        return [((x[i::n],), kwargs) for i in range(n)]  # interleaved rows

    def merge(outputs):
        calls["merge"] = len(outputs)
        out = torch.empty(sum(o.shape[0] for o in outputs), 4)
        for i, o in enumerate(outputs):
            out[i::len(outputs)] = o
        return out

    pipe = RoundPipe(model, devices=devices)
    x = torch.randn(6, 4)
    with torch.no_grad():
        out = pipe(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2, split_input=split, merge_output=merge))
    assert calls == {"split": 2, "merge": 2}
    assert_close(out, model(x).detach())


def test_custom_label_split(devices):
    model = nn.Sequential(nn.Linear(4, 1))
    pipe = RoundPipe(model, devices=devices)
    x, y = torch.randn(4, 4), torch.randn(4)
    labels = []

    def split_label(label, n):
        return [{"y": part} for part in label.chunk(n)]

    def loss_fn(out, label):
        labels.append(label)
        return ((out.squeeze(1) - label["y"]) ** 2).sum()

    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                                 run_config=RoundPipeRunConfig(num_microbatch=2, split_label=split_label))
    assert len(labels) == 2 and all(isinstance(lbl, dict) for lbl in labels)
    assert_close(loss, ((model(x).squeeze(1) - y) ** 2).sum().detach())


def test_packed_outputs_feed_the_next_roundpipe(devices):
    first, second = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 2))
    a = RoundPipe(first, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=False))
    b = RoundPipe(second, devices=devices)
    x = torch.randn(9, 4, requires_grad=True)
    packed = a(x)
    assert isinstance(packed, PackedMicrobatches) and len(packed) == 3
    out = b(packed)
    expected = second(first(x))
    assert_close(out, expected.detach())
    out.sum().backward()  # gradients flow through both RoundPipes
    a.synchronize()
    b.synchronize()
    xr = x.detach().clone().requires_grad_(True)
    first.zero_grad()
    second(first(xr)).sum().backward()
    assert_close(x.grad, xr.grad)


def test_split_function_errors_reach_the_caller(devices):
    pipe = RoundPipe(nn.Sequential(nn.Linear(2, 2)), devices=devices)
    bad = RoundPipeRunConfig(num_microbatch=2, split_input=lambda a, k, n: [(a, k)])
    with pytest.raises(RuntimeError, match="returned 1 microbatch values for 2"):
        pipe(torch.randn(4, 2), roundpipe_run_config=bad)

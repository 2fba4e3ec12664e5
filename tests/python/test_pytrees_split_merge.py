"""Pytrees through layers, the microbatch split/merge rules, custom split and
merge functions, and packed outputs feeding a next RoundPipe."""
import collections
import dataclasses

import pytest
import torch
from torch import nn

from roundpipe import PackedMicrobatches, RoundPipe, RoundPipeRunConfig

from conftest import assert_close

Pair = collections.namedtuple("Pair", ["hidden", "tag"])


@dataclasses.dataclass
class Note:
    text: str


class ToDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None, note=None):
        return {"h": self.lin(x), "mask": mask, "note": note, "n": 3, "scale": 0.5}


class FromDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, d):
        assert isinstance(d["note"], Note) and d["n"] == 3
        h = self.lin(d["h"]) * d["scale"]
        if d["mask"] is not None:
            h = h * d["mask"]
        return Pair(h, d["note"].text)


class FromPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, p):
        assert isinstance(p, Pair), type(p)
        return collections.OrderedDict(out=self.lin(p.hidden), tag=p.tag, mean=self.lin(p.hidden).mean())


def test_pytrees_pass_between_layers(devices):
    model = nn.Sequential(ToDict(), FromDict(), FromPair())
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x, mask = torch.randn(7, 4), (torch.rand(7, 1) > 0.3).float()
    with torch.no_grad():
        out = pipe(x, mask=mask, note=Note("hi"))
        ref = model[2](model[1](model[0](x, mask=mask, note=Note("hi"))))
    assert isinstance(out, collections.OrderedDict)
    assert out["tag"] == "hi"
    assert_close(out["out"], ref["out"])
    # 0-dim outputs are averaged over the microbatches (sizes 3, 2, 2).
    chunks = [ref["out"][:3], ref["out"][3:5], ref["out"][5:]]
    assert_close(out["mean"], torch.stack([c.mean() for c in chunks]).mean())


def test_hf_output_dataclasses_are_pytrees(devices):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class Out(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 5)

        def forward(self, x):
            logits = self.lin(x)
            return CausalLMOutputWithPast(loss=logits.pow(2).mean(), logits=logits)

    model = nn.Sequential(Out())
    pipe = RoundPipe(model, devices=devices)
    x = torch.randn(6, 4)
    out = pipe(x)
    assert isinstance(out, CausalLMOutputWithPast)
    assert out.logits.shape == (6, 5)
    out.loss.backward()  # the merged loss is connected to autograd
    pipe.synchronize()
    assert model[0].lin.weight.grad is not None
    # forward_backward's default loss_fn takes output.loss
    loss = pipe.forward_backward(input_args=(x,))
    assert loss.dim() == 0


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


def test_non_tensor_outputs_must_agree(devices):
    class Differ(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 1)

        def forward(self, x):
            return self.lin(x), int(x[0, 0].item())

    pipe = RoundPipe(Differ(), devices=devices)
    with pytest.raises(RuntimeError, match="differs between microbatches"):
        with torch.no_grad():
            pipe(torch.arange(6.0).view(6, 1))


def test_batch_smaller_than_microbatches_is_a_clear_error(devices):
    pipe = RoundPipe(nn.Sequential(nn.Linear(2, 2)), devices=devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=4))
    with pytest.raises(RuntimeError, match="lower num_microbatch"):
        pipe(torch.randn(2, 2))


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

"""The original's custom-data-types page: pytrees (dicts, namedtuples,
dataclasses, HuggingFace ModelOutput) between layers, and what the automatic
merge does with non-tensor leaves."""
import collections
import dataclasses

import pytest
import torch
from conftest import assert_close
from roundpipe import RoundPipe, RoundPipeRunConfig
from torch import nn

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

"""AutoRoundPipe on models that are not one Sequential (issue 17, item 5):
a UNet-like model with skip connections and a small ViT whose blocks are a
ModuleList chained through unmerged microbatches, trained against plain
PyTorch: step for step with synchronous steps, and against an oracle one
update behind with asynchronous ones (RoundPipe's semantics).

Tolerances: fp32 on both sides; the same products summed in another order
(microbatches, matmul blocking), so losses within 1e-5 relative and
weights within the Adam bound of conftest (steps * lr * GRAD_ERROR / eps)."""
import copy

import pytest
import roundpipe
import torch
from conftest import ADAM_EPS, assert_adam_weights_close, assert_close
from roundpipe import AutoRoundPipe, wrap_model_to_roundpipe
from roundpipe.roundpipe import PackedMicrobatches
from torch import nn


class UNetLike(nn.Module):
    """Two encoder levels, a bottleneck and two decoder levels that
    concatenate the encoder's features (skip connections) in the glue."""

    def __init__(self, c=8):
        super().__init__()
        conv = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(2, o), nn.SiLU())  # noqa: E731
        self.enc1, self.enc2 = conv(3, c), conv(c, 2 * c)
        self.mid = conv(2 * c, 2 * c)
        self.dec2, self.dec1 = conv(4 * c, c), conv(2 * c, c)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(nn.functional.avg_pool2d(e1, 2))
        m = self.mid(e2)
        d2 = self.dec2(torch.cat([m, e2], 1))
        d1 = self.dec1(torch.cat([nn.functional.interpolate(d2, scale_factor=2.0), e1], 1))
        return self.out(d1)


class Block(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Patches, a class token and positions in the glue; the blocks a
    ModuleList run one after another (chained through packed outputs)."""

    def __init__(self, dim=32, depth=3, classes=5):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def make(kind):
    torch.manual_seed(0)
    return UNetLike() if kind == "unet" else TinyViT()


def batches(kind, steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 3, 8, 8, generator=g)
        y = x.flip(1) if kind == "unet" else torch.randint(0, 5, (6,), generator=g)
        yield x, y


def loss_of(kind, out, y):
    return nn.functional.mse_loss(out, y) if kind == "unet" else nn.functional.cross_entropy(out, y)


def wrap(model, devices):
    wrapped = wrap_model_to_roundpipe(model, devices=devices, lower_threshold=1024, upper_threshold=8 * 1024,
                                      model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=2))
    assert isinstance(wrapped, AutoRoundPipe)
    assert len(wrapped.pipes) >= 3
    return wrapped


@pytest.mark.parametrize("kind", ["unet", "vit"])
def test_synchronous_steps_match_plain_pytorch_step_for_step(devices, kind):
    model, plain = make(kind), make(kind)
    wrapped = wrap(model, devices)
    opt = roundpipe.optim.Adam(wrapped.optim_parameters(), lr=1e-2, eps=ADAM_EPS)
    ref_opt = torch.optim.Adam(plain.parameters(), lr=1e-2, eps=ADAM_EPS)
    steps = 4
    for x, y in batches(kind, steps):
        loss = loss_of(kind, wrapped(x), y)
        loss.backward()
        wrapped.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        expected = loss_of(kind, plain(x), y)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(loss, expected, 1e-5)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert_adam_weights_close(p, q, steps=steps, lr=1e-2)


@pytest.mark.parametrize("kind", ["unet", "vit"])
def test_asynchronous_steps_run_one_update_behind(devices, kind):
    model, oracle = make(kind), make(kind)
    wrapped = wrap(model, devices)
    opt = roundpipe.optim.Adam(wrapped.optim_parameters(), lr=1e-2, eps=ADAM_EPS)
    ref_opt = torch.optim.Adam(oracle.parameters(), lr=1e-2, eps=ADAM_EPS)
    previous = copy.deepcopy(oracle.state_dict())  # the weights one update old
    steps = 4
    for x, y in batches(kind, steps):
        loss = loss_of(kind, wrapped(x), y)
        loss.backward()
        wrapped.step(lambda: (opt.step(), opt.zero_grad()))
        reader = make(kind)
        reader.load_state_dict(previous)
        expected = loss_of(kind, reader(x), y)
        expected.backward()
        previous = copy.deepcopy(oracle.state_dict())
        for p, r in zip(oracle.parameters(), reader.parameters()):
            p.grad = r.grad
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(loss, expected, 1e-5)
    wrapped.synchronize()
    for p, q in zip(model.parameters(), oracle.parameters()):
        assert_adam_weights_close(p, q, steps=steps, lr=1e-2)


def test_module_list_items_chain_through_packed_microbatches(devices):
    model = make("vit")
    plain = copy.deepcopy(model)
    wrapped = wrap(model, devices)
    names = [p.name for p in wrapped.pipes]
    assert ["blocks.0", "blocks.1", "blocks.2"] == [n for n in names if n.startswith("blocks")], names
    configs = {p.name: p.model_run_config for p in wrapped.pipes}
    assert configs["blocks.0"].merge_output is False and configs["blocks.1"].merge_output is False
    assert configs["blocks.2"].merge_output is None  # the last item merges
    x = torch.randn(6, 5, 32)
    with torch.no_grad():
        packed = model.blocks[0](x)
        assert isinstance(packed, PackedMicrobatches) and len(packed) == 2
        chained = model.blocks[2](model.blocks[1](packed))
        assert isinstance(chained, torch.Tensor)
        expected = plain.blocks[2](plain.blocks[1](plain.blocks[0](x)))
        assert_close(chained, expected, 1e-5)
        # Glue that computes with packed outputs gets them merged.
        assert_close(packed + 1, plain.blocks[0](x) + 1, 1e-5)
        assert packed.shape == (6, 5, 32)


def test_a_huggingface_model_wraps_automatically_and_trains_as_transformers():
    """Issue 32: use_sequential_preset=False on a HuggingFace causal LM (its
    decoder layers a ModuleList, each called with the hidden states packed
    from the one before and keyword arguments: the attention mask, the
    rotary embeddings) gives transformers' loss and gradients; keyword
    tensors with the batch's rows are cut as the packed microbatches are."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hf_models import tiny_qwen3

    hf = tiny_qwen3()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, use_sequential_preset=False, devices="sim:2")
    assert isinstance(pipe, AutoRoundPipe)
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    out = pipe(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    pipe.synchronize()
    expected = oracle(input_ids=ids, attention_mask=mask, labels=ids)
    expected.loss.backward()
    assert_close(out.loss.detach(), expected.loss.detach())
    ours = dict(hf.named_parameters())
    for name, q in oracle.named_parameters():
        assert_close(ours[name].grad, q.grad, 1e-4)

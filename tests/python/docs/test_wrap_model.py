"""The original's wrap-model page: wrap_model_to_roundpipe on models without a
preset (thresholds, nested Sequentials, skip_modules, override_config, the
preset fallbacks); AutoRoundPipe on other models is in
test_wrap_model_auto_roundpipe.py, the presets in ../test_hf_presets.py."""
import copy

import roundpipe
import torch
from conftest import ADAM_EPS, assert_adam_weights_close, assert_close
from roundpipe import AutoRoundPipe, RoundPipe, wrap_model_to_roundpipe
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, h):
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))


class Custom(nn.Module):
    """Glue in forward (residuals, a loop over a ModuleList) that no
    Sequential can express."""

    def __init__(self, vocab=50, dim=64, depth=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for i, block in enumerate(self.blocks):
            h = h + block(h) / (i + 1)
        return self.head(self.norm(h))


def test_auto_split_matches_plain(devices):
    model = Custom()
    plain = copy.deepcopy(model)
    wrapped = wrap_model_to_roundpipe(model, devices=devices, lower_threshold=8 * 1024,
                                      upper_threshold=150 * 1024)
    assert isinstance(wrapped, AutoRoundPipe)
    names = sorted(p.name for p in wrapped.pipes)
    # (norm, under lower_threshold, is a RoundPipe of one microbatch, as in the original)
    assert names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "embed", "head", "norm"], names
    assert next(p for p in wrapped.pipes if p.name == "norm").model_run_config.num_microbatch == 1
    ids = torch.randint(0, 50, (6, 10))
    with torch.no_grad():
        assert_close(wrapped(ids), plain(ids))

    opt = roundpipe.optim.Adam(wrapped.optim_parameters(), lr=1e-2, eps=ADAM_EPS)  # see conftest
    ref_opt = torch.optim.Adam(plain.parameters(), lr=1e-2, eps=ADAM_EPS)
    for _ in range(3):
        loss = nn.functional.cross_entropy(wrapped(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        wrapped.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref_opt.zero_grad()
        expected = nn.functional.cross_entropy(plain(ids).flatten(0, 1), ids.flatten())
        expected.backward()
        ref_opt.step()
        assert_close(loss, expected, 1e-5)
    for p, q in zip(model.parameters(), plain.parameters()):
        # 3 Adam steps on gradients that differ by rounding: 3 * lr * GRAD_ERROR / ADAM_EPS = 3e-4
        assert_adam_weights_close(p, q, steps=3, lr=1e-2)
    assert [n for n, _ in model.state_dict().items()] == [n for n in plain.state_dict()]


def test_sequential_and_no_preset_fallbacks():
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert type(wrap_model_to_roundpipe(seq, use_sequential_preset=False)) is RoundPipe
    assert type(wrap_model_to_roundpipe(nn.Sequential(nn.Linear(4, 4)))) is RoundPipe
    assert isinstance(wrap_model_to_roundpipe(Custom(), use_sequential_preset=None), AutoRoundPipe)


class Nested(nn.Module):
    """A nested Sequential (one multi-layer RoundPipe), a part the caller
    skips by passing the module itself, and one with a config of its own."""

    def __init__(self, dim=64):
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.trunk = nn.Sequential(Block(dim), nn.Tanh(), Block(dim))
        self.side = Block(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, h):
        h = self.stem(h)
        return self.head(self.trunk(h) + self.side(h))


def test_the_originals_wrapping_rules(devices):
    model = Nested()
    plain = copy.deepcopy(model)
    config = roundpipe.RoundPipeRunConfig(num_microbatch=3)
    wrapped = wrap_model_to_roundpipe(model, devices=devices, lower_threshold=8 * 1024,
                                      upper_threshold=40 * 1024, skip_modules=[model.side],
                                      override_config={model.head: config})
    pipes = {p.name: p for p in wrapped.pipes}
    assert sorted(pipes) == ["head", "stem", "trunk"], sorted(pipes)
    assert pipes["trunk"].num_layers == 3  # the nested Sequential, one layer per child
    assert pipes["head"].model_run_config is config
    x = torch.randn(6, 64)
    with torch.no_grad():
        assert_close(wrapped(x), plain(x))
    loss = wrapped(x).square().mean()
    loss.backward()
    wrapped.synchronize()
    plain(x).square().mean().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)
    with torch.no_grad():
        try:
            wrap_model_to_roundpipe(Nested(), use_sequential_preset=True)
        except NotImplementedError as e:
            assert "no preset for Nested" in str(e)
        else:
            raise AssertionError("a missing preset was accepted")


def test_a_preset_chosen_by_default_says_so(capsys):
    """As the original: use_sequential_preset=None that finds a preset prints
    an [INFO] line naming the model's type (stderr); True chooses silently."""
    import sys
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hf_models import tiny_qwen3

    wrap_model_to_roundpipe(tiny_qwen3(), devices="sim:1")
    err = capsys.readouterr().err
    assert "[INFO] Replace model" in err and "Qwen3ForCausalLM" in err
    wrap_model_to_roundpipe(tiny_qwen3(), devices="sim:1", use_sequential_preset=True)
    assert "[INFO]" not in capsys.readouterr().err

"""Shared fixtures: every engine test runs on each device backend (one test,
every backend): simulated devices always, CUDA where a GPU is visible."""
import copy

import pytest
import torch
from torch import nn

BACKENDS = ["sim:1", "sim:2", "sim:3,jitter_us=200,chunk=16KiB"]
if torch.cuda.is_available():
    BACKENDS.append("cuda")


@pytest.fixture(params=BACKENDS)
def devices(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class Block(nn.Module):
    """A residual MLP block; its input and output are (hidden, extra) pairs
    so that layers pass pytrees, not just tensors."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, inputs):
        h, scale = inputs
        return h + self.fc2(torch.relu(self.fc1(self.norm(h)))) * scale, scale


class Embed(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(4, dim)

    def forward(self, x, scale=1.0):
        return self.proj(x), scale


class Head(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.out = nn.Linear(dim, 3)

    def forward(self, inputs):
        return self.out(inputs[0])


def make_model(dim=16, blocks=4, dtype=torch.float32):
    return nn.Sequential(Embed(dim), *[Block(dim) for _ in range(blocks)], Head(dim)).to(dtype)


@pytest.fixture
def model_pair():
    """(model to wrap, an identical plain copy as the oracle)."""
    model = make_model()
    return model, copy.deepcopy(model)


def mse(out, target):
    return ((out - target) ** 2).mean()


def assert_close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)

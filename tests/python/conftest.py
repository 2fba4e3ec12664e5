"""Shared fixtures: every engine test runs on each device backend (one test,
every backend): simulated devices always, CUDA where a GPU is visible."""
import copy
import os

import pytest
import torch
from torch import nn

# LibTorch's CPU kernels on two threads, the CI machine's count, on any
# machine: a simulated device charges what CPU kernels allocate on its
# worker threads, and some allocate scratch for each thread (CPU flash
# attention), so the tests' budgets would mean less with more cores (at 64
# threads test_loss_fn_row_chunks's 1.5 MB device ran out of memory on that
# scratch). tests/test_main.cpp does the same for the C++ tests.
torch.set_num_threads(2)

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
    """|a - b| <= tol * (|b| + max(1, max|b|)) elementwise: a sum's fp32
    rounding error is relative to its largest terms, so a small element of a
    large tensor (a gradient of 8 next to one of 1e-3) gets the tensor's scale."""
    ref = torch.as_tensor(b).detach()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, scale))


# Weights after Adam steps. Adam moves a weight by lr * m / (sqrt(v) + eps):
# with the default eps=1e-8 an element whose gradient is near zero moves by up
# to lr on rounding noise alone (1e-4 apart after 4 steps on AVX2), so weights
# after Adam cannot be compared at any tolerance. Tests that compare them use
# ADAM_EPS on both sides: then a gradient difference d changes a step by at
# most lr * d / ADAM_EPS (bias-corrected |m| <= 1.05 sqrt(v) within ten steps
# of betas (0.9, 0.999)).
ADAM_EPS = 1e-3
# The gradient difference, ours against the oracle, at any step: the same fp32
# products (|g| <~ 1) summed in another order (microbatches; matmul blocking by
# SIMD width and thread count; cuBLAS against the CPU): a few ulps of max|g|,
# measured <= 7e-7 with the AVX-512, AVX2 and baseline kernels, 1 or 2 threads,
# an AMD and an Intel CPU and CUDA (H200).
GRAD_ERROR = 1e-5


def adam_weight_tol(steps, lr, grad_error=GRAD_ERROR):
    """Bound on |ours - oracle| for weights after `steps` Adam steps at
    ADAM_EPS: steps * lr * grad_error / ADAM_EPS (the weights' own rounding,
    < 1e-6 over a few steps, is far below it)."""
    return steps * lr * grad_error / ADAM_EPS


def assert_adam_weights_close(a, b, steps, lr, grad_error=GRAD_ERROR):
    torch.testing.assert_close(a, b, rtol=0, atol=adam_weight_tol(steps, lr, grad_error))


def roundpipe_train_binary():
    """The C++ roundpipe-train of this checkout (or $ROUNDPIPE_TRAIN); skips
    the test when it is not built."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    binary = os.environ.get("ROUNDPIPE_TRAIN", os.path.join(root, "build", "roundpipe-train"))
    if not os.path.exists(binary):
        pytest.skip(f"{binary} is not built (scripts/build.sh build; scripts/test.sh builds it)")
    return binary

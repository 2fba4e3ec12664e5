"""The original's module paths that its benchmark scripts import (issue 32):
roundpipe.models.function's loss functions against transformers' own
ForCausalLMLoss (the oracle), and roundpipe.device's device_list."""
import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

import roundpipe.models.function as function
from roundpipe.device import device_list, get_num_devices
from roundpipe.models import SUPPORTED_MODELS
from roundpipe.models.function import ChunkedCompileLinearForCausalLMLoss, CompileForCausalLMLoss

from conftest import assert_close


TOL = 1e-5  # both compute the cross-entropy in float32


def data(seed=0, b=3, t=11, d=8, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    head = nn.Linear(d, v, bias=False).double()
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :4] = -100
    labels[2, 7:] = -100
    return hidden, head, labels


@pytest.mark.parametrize("items", [None, 17])
def test_the_chunked_loss_is_transformers_causal_lm_loss(monkeypatch, items):
    """Chunks of 5 tokens (33 in all) give transformers' loss and gradients,
    the mean over labelled tokens or the sum divided by num_items_in_batch."""
    monkeypatch.setattr(function, "TOKEN_CHUNK_SIZE", 5)
    hidden, head, labels = data()
    h1 = hidden.clone().requires_grad_()
    loss = ChunkedCompileLinearForCausalLMLoss(h1, head, labels, num_items_in_batch=items)
    loss.backward()
    ours = (h1.grad, head.weight.grad.clone())
    head.weight.grad = None
    h2 = hidden.clone().requires_grad_()
    expected = ForCausalLMLoss(head(h2), labels, head.out_features, num_items_in_batch=items)
    expected.backward()
    assert_close(loss, expected, TOL)
    assert_close(ours[0], h2.grad, TOL)
    assert_close(ours[1], head.weight.grad, TOL)
    logits = head(hidden).detach()
    assert_close(CompileForCausalLMLoss(logits, labels, head.out_features, num_items_in_batch=items),
                 ForCausalLMLoss(logits, labels, head.out_features, num_items_in_batch=items), TOL)


def test_shift_labels_and_ignore_index_are_transformers():
    hidden, head, labels = data(1)
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    shifted[shifted == -100] = -1
    with torch.no_grad():
        ours = ChunkedCompileLinearForCausalLMLoss(hidden, head, None, ignore_index=-1, shift_labels=shifted)
        expected = ForCausalLMLoss(head(hidden), None, head.out_features, ignore_index=-1, shift_labels=shifted)
    assert_close(ours, expected, TOL)


def test_device_list_names_every_visible_cuda_device():
    assert get_num_devices() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for i, d in enumerate(device_list):
        assert d.id == i and d.device == torch.device("cuda", i)
    assert "Qwen3ForCausalLM" in SUPPORTED_MODELS

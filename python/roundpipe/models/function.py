"""roundpipe.models.function: the original's loss functions for causal
language models, by its names and signatures, so that its scripts (its
benchmark/train.py warms the loss kernel with
ChunkedCompileLinearForCausalLMLoss) run unchanged. Plain PyTorch: the
presets compute their loss in C++ (the fused kernels), these are for a
caller's own code.

The causal-LM loss is transformers': labels shifted left by one (or
`shift_labels` as given), `ignore_index` ignored, cross-entropy in float32
summed and divided by `num_items_in_batch` when given, else by the number of
labelled tokens (their mean).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

TOKEN_CHUNK_SIZE = 4096  # tokens per chunk of the chunked linear + cross-entropy

__all__ = ["CompileCrossEntropy", "CompileForCausalLMLoss", "CompileLinearCrossEntropy",
           "ChunkedCompileLinearCrossEntropy", "ChunkedCompileLinearForCausalLMLoss", "TOKEN_CHUNK_SIZE"]


def _targets(labels: torch.Tensor, ignore_index: int, shift_labels: Optional[torch.Tensor]):
    """The target of every position, flattened: labels shifted left by one
    (the last position has none), or shift_labels as given."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _reduce(summed: torch.Tensor, targets: torch.Tensor, ignore_index: int, num_items_in_batch):
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(summed.device)
        return summed / num_items_in_batch
    return summed / (targets != ignore_index).sum().clamp_min(1)


def CompileCrossEntropy(logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None,
                        ignore_index: int = -100, **kwargs) -> torch.Tensor:
    """Cross-entropy of [N, V] logits (computed in float32) against N
    targets: summed over the labelled ones, divided by num_items_in_batch
    when given, else their mean."""
    summed = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")
    return _reduce(summed, targets, ignore_index, num_items_in_batch)


def CompileForCausalLMLoss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None,
                           num_items_in_batch=None, ignore_index: int = -100,
                           shift_labels: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
    """transformers' ForCausalLMLoss on [B, T, V] logits (the signature of a
    model's loss_function)."""
    targets = _targets(labels, ignore_index, shift_labels).to(logits.device)
    vocab = logits.shape[-1] if vocab_size is None else vocab_size
    return CompileCrossEntropy(logits.reshape(-1, vocab), targets, num_items_in_batch, ignore_index)


def CompileLinearCrossEntropy(hidden_states: torch.Tensor, weight: torch.Tensor,
                              bias: Optional[torch.Tensor], targets: torch.Tensor,
                              ignore_index: int = -100) -> torch.Tensor:
    """The summed cross-entropy of `hidden_states @ weight.T + bias` against
    the targets (labelled tokens only)."""
    logits = F.linear(hidden_states, weight, bias)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


class ChunkedCompileLinearCrossEntropy(torch.autograd.Function):
    """The summed linear + cross-entropy over [N, D] hidden states, TOKEN_CHUNK_SIZE
    tokens at a time: the [N, V] logits never exist at once; the backward
    recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden_states, weight, bias, targets, ignore_index):
        total = hidden_states.new_zeros((), dtype=torch.float32)
        with torch.no_grad():
            for start in range(0, hidden_states.shape[0], TOKEN_CHUNK_SIZE):
                part = slice(start, start + TOKEN_CHUNK_SIZE)
                total += CompileLinearCrossEntropy(hidden_states[part], weight, bias, targets[part],
                                                   ignore_index)
        ctx.save_for_backward(hidden_states, weight, bias, targets)
        ctx.ignore_index = ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden_states, weight, bias, targets = ctx.saved_tensors
        grads = [torch.zeros_like(hidden_states), torch.zeros_like(weight, dtype=torch.float32),
                 None if bias is None else torch.zeros_like(bias, dtype=torch.float32)]
        for start in range(0, hidden_states.shape[0], TOKEN_CHUNK_SIZE):
            part = slice(start, start + TOKEN_CHUNK_SIZE)
            with torch.enable_grad():
                h = hidden_states[part].detach().requires_grad_(hidden_states.requires_grad)
                w = weight.detach().requires_grad_(weight.requires_grad)
                b = None if bias is None else bias.detach().requires_grad_(bias.requires_grad)
                loss = CompileLinearCrossEntropy(h, w, b, targets[part], ctx.ignore_index)
                inputs = [t for t in (h, w, b) if t is not None and t.requires_grad]
                got = iter(torch.autograd.grad(loss * grad_total, inputs)) if inputs else iter(())
            for i, t in enumerate((h, w, b)):
                if t is not None and t.requires_grad:
                    g = next(got)
                    if i == 0:
                        grads[0][part] = g
                    else:
                        grads[i] += g
        return (grads[0] if hidden_states.requires_grad else None,
                grads[1].to(weight.dtype) if weight.requires_grad else None,
                None if bias is None or not bias.requires_grad else grads[2].to(bias.dtype), None, None)


def ChunkedCompileLinearForCausalLMLoss(hidden_states: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor,
                                        num_items_in_batch=None, ignore_index: int = -100,
                                        shift_labels: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
    """transformers' causal-LM loss of `lm_head(hidden_states)` ([B, T, D]
    hidden states, [B, T] labels) without materialising the [B T, V]
    logits."""
    targets = _targets(labels, ignore_index, shift_labels).to(hidden_states.device)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    summed = ChunkedCompileLinearCrossEntropy.apply(flat, lm_head.weight, lm_head.bias, targets, ignore_index)
    return _reduce(summed, targets, ignore_index, num_items_in_batch)

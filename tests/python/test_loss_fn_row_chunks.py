"""Note [A caller's loss over row chunks]: under a budget that holds only some
of the tail's activations, the original's idiom (loss_fn=lambda o, _: o.loss
/ num_microbatch, the logits not returned, as its benchmark runs it) lets the
fused tail run in chunks of rows, checked, with
transformers' losses and gradients; a loss_fn that is not linear in the loss
keeps whole microbatches, and one that only looks linear has its call redone
whole. Every result is transformers' on whole microbatches."""

import copy

import torch

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

from conftest import assert_close
from hf_models import tiny_qwen3

TOL = 2e-5
CALLS = 4


def padded_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (8, 64), generator=g)
    mask = torch.ones(8, 64, dtype=torch.long)
    for row, length in enumerate([64, 40, 12, 64, 50, 33, 64, 20]):
        mask[row, length:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def train(loss_fn, of_microbatch_losses, stat="tail_microbatches_in_row_chunks"):
    """CALLS calls on each of two short simulated budgets (one of them runs the
    tail in chunks of rows where the loss allows); asserts each call's loss and
    the accumulated gradients against transformers on whole microbatches,
    where the call's loss is of_microbatch_losses(the two microbatches' mean
    losses). Returns per budget pipeline_stats()[stat] after each call (by
    default the tail's microbatches run in chunks)."""
    inputs = padded_batch()
    chunked = []
    for kib in (1500, 1600):
        hf = tiny_qwen3()
        oracle = copy.deepcopy(hf)
        pipe = wrap_model_to_roundpipe(hf, devices=f"sim:1,mem={kib}KiB",
                                       model_run_config=RoundPipeRunConfig(num_microbatch=2))
        halves = [{k: v[rows] for k, v in inputs.items()} for rows in (slice(0, 4), slice(4, 8))]
        expected = of_microbatch_losses([oracle(**h).loss for h in halves])
        (expected * CALLS).backward()
        counts = []
        for call in range(CALLS):
            loss = pipe.forward_backward(input_kwargs=dict(inputs, return_logits=False), loss_fn=loss_fn)
            assert_close(loss, expected.detach(), TOL)
            counts.append(pipe.pipeline_stats()[stat])
        pipe.synchronize()
        ours = dict(hf.named_parameters())
        for name, q in oracle.named_parameters():
            assert_close(ours[name].grad, q.grad, 1e-4)
        chunked.append(counts)
    return chunked


def test_the_originals_loss_fn_runs_the_tail_in_checked_chunks_of_rows():
    chunked = train(lambda o, _: o.loss / 2, lambda losses: sum(losses) / 2)
    assert any(counts[-1] > 0 for counts in chunked), f"no budget ran the tail in chunks: {chunked}"


def test_a_loss_fn_not_linear_in_the_loss_keeps_whole_microbatches():
    chunked = train(lambda o, _: o.loss ** 2, lambda losses: sum(x ** 2 for x in losses))
    assert all(counts[-1] == 0 for counts in chunked), chunked


def test_a_loss_fn_linear_only_near_the_whole_loss_has_its_call_redone_whole():
    # Linear at a microbatch's loss (~4.6) and twice it, so chunks are
    # planned; a chunk's part (below 3) gets another gradient, so the check
    # fails, the call is redone with whole microbatches, and later calls keep
    # them whole.
    def kinked(o, _):
        return o.loss * (0.5 if o.loss.item() > 3 else 1.0)

    chunked = train(kinked, lambda losses: sum(x * (0.5 if x.item() > 3 else 1.0) for x in losses),
                    stat="calls_redone_for_the_loss_check")
    assert any(redone[-1] == 1 for redone in chunked), f"no call was redone: {chunked}"
    assert all(redone[-1] <= 1 for redone in chunked), chunked


def test_a_sequence_of_losses_is_summed_once_per_microbatch():
    # The loss_fn's calls for a chunk's gradient only are not recorded
    # (loss_value_is_reported()); the tail runs in chunks here.
    def two(o, _):
        return [o.loss / 2, o.loss / 4]

    inputs = padded_batch()
    hf = tiny_qwen3()
    pipe = wrap_model_to_roundpipe(hf, devices="sim:1,mem=1500KiB",
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    oracle = copy.deepcopy(hf)
    halves = [{k: v[rows] for k, v in inputs.items()} for rows in (slice(0, 4), slice(4, 8))]
    with torch.no_grad():
        total = sum(oracle(**h).loss for h in halves)
    for _ in range(CALLS):
        first, second = pipe.forward_backward(input_kwargs=dict(inputs, return_logits=False), loss_fn=two)
        assert_close(first, total / 2, TOL)
        assert_close(second, total / 4, TOL)
    pipe.synchronize()
    assert pipe.pipeline_stats()["tail_microbatches_in_row_chunks"] > 0

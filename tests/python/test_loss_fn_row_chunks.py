"""Row chunks of the fused tail under a budget that holds only some of its
activations, with transformers' losses and gradients on whole microbatches:
the default loss (the model's, which adds up over rows: Note [Tail row
chunks]), and a loss_fn of the caller's (Note [A caller's loss over row
chunks]): the original's idiom (loss_fn=lambda o, _: o.loss / num_microbatch,
the logits not returned, as its benchmark runs it) runs in checked chunks; a
loss_fn that is not linear in the loss keeps whole microbatches, and one that
only looks linear has its call redone whole."""

import copy

import torch

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

from conftest import assert_close
from hf_models import padded_rows_batch, tiny_qwen3

TOL = 2e-5
CALLS = 4


def halves(inputs):
    return [{k: v[rows] for k, v in inputs.items()} for rows in (slice(0, 4), slice(4, 8))]


def train(loss_fn, expected_of, stat="tail_microbatches_in_row_chunks"):
    """CALLS calls in 2 microbatches on each of two short simulated budgets
    (one of them runs the tail in chunks of rows where the loss allows);
    asserts each call's loss and the accumulated gradients against
    expected_of(the transformers model), the call's loss. Returns per budget
    pipeline_stats()[stat] after each call (by default the tail's
    microbatches run in chunks)."""
    inputs = padded_rows_batch()
    chunked = []
    for kib in (1500, 1600):
        hf = tiny_qwen3()
        oracle = copy.deepcopy(hf)
        pipe = wrap_model_to_roundpipe(hf, devices=f"sim:1,mem={kib}KiB",
                                       model_run_config=RoundPipeRunConfig(num_microbatch=2))
        expected = expected_of(oracle)
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


def of_microbatches(f):
    """The call's loss: f(the two microbatches' mean losses) in transformers."""
    return lambda oracle: f([oracle(**h).loss for h in halves(padded_rows_batch())])


def test_the_default_loss_runs_the_tail_in_chunks_of_rows():
    chunked = train(None, lambda oracle: oracle(**padded_rows_batch()).loss)
    assert any(counts[-1] > 0 for counts in chunked), f"no budget ran the tail in chunks: {chunked}"


def test_the_originals_loss_fn_runs_the_tail_in_checked_chunks_of_rows():
    chunked = train(lambda o, _: o.loss / 2, of_microbatches(lambda losses: sum(losses) / 2))
    assert any(counts[-1] > 0 for counts in chunked), f"no budget ran the tail in chunks: {chunked}"


def test_a_loss_fn_not_linear_in_the_loss_keeps_whole_microbatches():
    chunked = train(lambda o, _: o.loss ** 2, of_microbatches(lambda losses: sum(x ** 2 for x in losses)))
    assert all(counts[-1] == 0 for counts in chunked), chunked


def test_a_loss_fn_linear_only_near_the_whole_loss_has_its_call_redone_whole():
    # Linear at a microbatch's loss (~4.6) and twice it, so chunks are
    # planned; a chunk's part (below 3) gets another gradient, so the check
    # fails, the call is redone with whole microbatches, and later calls keep
    # them whole.
    def kinked(o, _):
        return o.loss * (0.5 if o.loss.item() > 3 else 1.0)

    chunked = train(kinked, of_microbatches(lambda losses: sum(x * (0.5 if x.item() > 3 else 1.0) for x in losses)),
                    stat="calls_redone_for_the_loss_check")
    assert any(redone[-1] == 1 for redone in chunked), f"no call was redone: {chunked}"
    assert all(redone[-1] <= 1 for redone in chunked), chunked


def test_a_sequence_of_losses_is_summed_once_per_microbatch():
    # The loss_fn's calls for a chunk's gradient only are not recorded
    # (loss_value_is_reported()); the tail runs in chunks here.
    def two(o, _):
        return [o.loss / 2, o.loss / 4]

    inputs = padded_rows_batch()
    hf = tiny_qwen3()
    pipe = wrap_model_to_roundpipe(hf, devices="sim:1,mem=1500KiB",
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    oracle = copy.deepcopy(hf)
    with torch.no_grad():
        total = sum(oracle(**h).loss for h in halves(inputs))
    for _ in range(CALLS):
        first, second = pipe.forward_backward(input_kwargs=dict(inputs, return_logits=False), loss_fn=two)
        assert_close(first, total / 2, TOL)
        assert_close(second, total / 4, TOL)
    pipe.synchronize()
    assert pipe.pipeline_stats()["tail_microbatches_in_row_chunks"] > 0


def test_a_loss_fn_that_cannot_run_on_a_detached_copy_keeps_whole_microbatches():
    # Dividing in place works on the model's output; on the detached copy
    # the check would use (a leaf), autograd refuses it.
    chunked = train(lambda o, _: o.loss.div_(2), of_microbatches(lambda losses: sum(losses) / 2))
    assert all(counts[-1] == 0 for counts in chunked), chunked

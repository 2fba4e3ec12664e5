"""Issue 32: a script written with the original's idioms trains as the
original's documented semantics say, step for step. The oracle is plain
transformers + torch.optim.Adam doing exactly that: per microbatch, the
model's loss (that microbatch's own mean over its labelled tokens) through
loss_fn, backpropagated as is; one Adam step per call on those gradients; an
asynchronous step, so that call k runs on the weights of update k - 1 (the
first two calls on the initial weights)."""
import copy

import pytest
import torch

import roundpipe
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

from conftest import ADAM_EPS, assert_adam_weights_close, assert_close
from hf_models import tiny_qwen3

STEPS, MICROBATCHES, LR = 10, 2, 1e-2


def batches():
    """Ten padded batches of 4 rows (labels -100 on the padding): microbatch
    means then differ from the batch's token-weighted mean."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (4, 12), generator=g)
        mask = torch.ones_like(ids)
        for row, length in enumerate(torch.randint(3, 13, (4,), generator=g).tolist()):
            mask[row, length:] = 0
        out.append(dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)))
    return out


# The original's loss_fn idioms: its benchmark's (the loss over the
# microbatch count), and the model's loss as it is.
IDIOMS = {"divided": lambda o, _: o.loss / MICROBATCHES, "as_is": lambda o, _: o.loss}


@pytest.mark.parametrize("idiom", sorted(IDIOMS))
def test_ten_steps_of_the_originals_idioms_match_the_documented_semantics(idiom):
    loss_fn = IDIOMS[idiom]
    hf = tiny_qwen3()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices="sim:2", optim_dtype=torch.float32, use_sequential_preset=True,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=MICROBATCHES))
    optim = roundpipe.optim.Adam(pipe.optim_parameters(), lr=LR, eps=ADAM_EPS)
    data = batches()
    losses = []
    for inputs in data:
        losses.append(float(pipe.forward_backward(input_kwargs=dict(inputs, return_logits=False),
                                                  loss_fn=loss_fn)))
        pipe.step(lambda: (optim.step(), optim.zero_grad(), None)[-1])
    pipe.synchronize()

    opt = torch.optim.Adam(oracle.parameters(), lr=LR, eps=ADAM_EPS)
    stale = copy.deepcopy(oracle.state_dict())  # the weights a call reads: one update old
    expected = []
    for inputs in data:
        reader = copy.deepcopy(oracle)
        reader.load_state_dict(stale)
        total = 0.0
        for rows in (slice(0, 2), slice(2, 4)):  # the original's split: earlier chunks larger
            loss = loss_fn(reader(**{k: v[rows] for k, v in inputs.items()}), None)
            loss.backward()
            total += loss.item()
        expected.append(total)
        stale = copy.deepcopy(oracle.state_dict())
        for p, r in zip(oracle.parameters(), reader.parameters()):
            p.grad = r.grad
        opt.step()
        opt.zero_grad()
    # Losses: fp32 forward passes on weights equal within the bound below.
    assert_close(torch.tensor(losses), torch.tensor(expected), 1e-4)
    ours = dict(hf.named_parameters())
    for n, q in oracle.named_parameters():
        assert_adam_weights_close(ours[n], q, steps=STEPS, lr=LR)

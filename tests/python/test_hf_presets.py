"""HuggingFace Qwen3/Llama wrapped with the presets match transformers +
PyTorch: losses, logits, gradients (with right and left padding and packed
documents, the loss token-weighted over any number of microbatches), and
training (sync: step for step; async: against a one-step-delay oracle).

Tolerances: fp32 on both sides, the same products summed in another order
(matmul blocking; attention over each sequence's own keys rather than a
masked row of the batch; microbatch sums): a few ulps of each tensor's
largest element, grown through 3 layers and the loss; TOL for the loss,
1e-4 (scaled by the tensor's largest element, see assert_close) for
gradients and logits."""
import copy

import pytest
import torch

import roundpipe
from roundpipe import CausalLMRoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe

from conftest import ADAM_EPS, assert_adam_weights_close, assert_close
from hf_models import MODELS, tiny_qwen3, tiny_qwen3_moe

TOL = 2e-5


def batch(seed=0, b=4, t=12, pad=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    labels = ids.clone()
    if pad:
        mask[1, 8:] = 0
        mask[3, 5:] = 0
        labels[mask == 0] = -100
    return ids, mask, labels


def hf_loss(model, ids, mask, labels):
    """The oracle for forward_backward: transformers on the whole batch (the
    mean over all its labelled tokens), whatever the microbatch count."""
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def masked_batch(kind, seed=0):
    """Keyword inputs of a batch: rows of 12, 7, 3 and 10 tokens padded on the
    right or on the left, or two rows of packed documents (position_ids
    restarting at 0, no mask, the first label of each document -100, as
    DataCollatorWithFlattening makes them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (4, 12), generator=g)
    if kind == "packed":
        documents = [[5, 3, 4], [2, 1, 6, 3]]
        positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
        labels = ids[:2].clone()
        labels[positions == 0] = -100
        return dict(input_ids=ids[:2], position_ids=positions, labels=labels)
    mask = torch.ones(4, 12, dtype=torch.long)
    for row, length in enumerate([12, 7, 3, 10]):
        if kind == "right":
            mask[row, length:] = 0
        else:
            mask[row, :12 - length] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("pad", [False, True])
def test_loss_and_gradients_match_transformers(devices, name, pad):
    hf = MODELS[name]()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, use_sequential_preset=True, devices=devices,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert isinstance(pipe, CausalLMRoundPipe)
    assert pipe.num_layers == hf.config.num_hidden_layers + 2
    ids, mask, labels = batch(pad=pad)
    loss = pipe.forward_backward(input_kwargs=dict(input_ids=ids, attention_mask=mask, labels=labels))
    pipe.synchronize()
    expected = hf_loss(oracle, ids, mask, labels)
    expected.backward()
    assert_close(loss, expected.detach(), TOL)
    ours = dict(hf.named_parameters())
    for n, q in oracle.named_parameters():
        assert ours[n].grad is not None, n
        assert_close(ours[n].grad, q.grad, 1e-4)


def test_labels_give_the_loss_and_the_logits_by_default():
    """As transformers and the original (return_logits defaults to True): a
    call with labels returns both; forward_backward with the default loss_fn
    and no outputs to return, where no logits can be seen, computes the loss
    in chunks without them (the same loss); return_logits=False at the wrap
    keeps them out of every call."""
    hf = tiny_qwen3()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices="sim:2", model_run_config=RoundPipeRunConfig(num_microbatch=1))
    ids, mask, labels = batch(pad=True)
    with torch.no_grad():
        out = pipe(ids, attention_mask=mask, labels=labels)
        ref = oracle(input_ids=ids, attention_mask=mask, labels=labels)
    keep = mask.bool()
    assert out.logits is not None
    assert_close(out.logits[keep], ref.logits[keep], 1e-4)
    assert_close(out.loss, ref.loss, TOL)
    loss, merged = pipe.forward_backward(input_kwargs=dict(input_ids=ids, attention_mask=mask, labels=labels),
                                         return_outputs=True)
    assert merged.logits is not None and merged.logits.shape == ref.logits.shape
    assert_close(pipe.forward_backward(input_kwargs=dict(input_ids=ids, attention_mask=mask, labels=labels)),
                 ref.loss, TOL)
    lean = wrap_model_to_roundpipe(tiny_qwen3(), devices="sim:1", return_logits=False)
    with torch.no_grad():
        assert lean(ids, attention_mask=mask, labels=labels).logits is None


@pytest.mark.parametrize("name", ["qwen3", "llama-tied-rope-scaling"])
def test_logits_with_return_logits(devices, name):
    hf = MODELS[name]()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices=devices, return_logits=True)
    ids, mask, labels = batch(pad=True)
    with torch.no_grad():
        out = pipe(ids, attention_mask=mask)
        ref = oracle(input_ids=ids, attention_mask=mask)
        assert out.loss is None
        keep = mask.bool()
        assert_close(out.logits[keep], ref.logits[keep], 1e-4)
        # per call: return_logits=False with labels gives the loss only
        out = pipe(ids, labels=labels, return_logits=False,
                   roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1))
        assert out.logits is None
        assert_close(out.loss, oracle(input_ids=ids, labels=labels).loss, TOL)
        # transformers' logits_to_keep (the last k positions), and its cache
        # arguments, ignored with a warning as in the original
        out = pipe(ids, logits_to_keep=3)
        assert_close(out.logits, oracle(input_ids=ids, logits_to_keep=3).logits, 1e-4)
        with pytest.warns(UserWarning, match="no KV cache"):
            out = pipe(ids, use_cache=True)
        assert_close(out.logits, oracle(input_ids=ids).logits, 1e-4)
    # inputs_embeds in place of input_ids, gradients flowing into them
    embeds = oracle.get_input_embeddings()(ids).detach().requires_grad_(True)
    oracle_embeds = embeds.detach().clone().requires_grad_(True)
    out = pipe(inputs_embeds=embeds, attention_mask=mask, labels=labels, return_logits=True)
    out.loss.backward()
    # (forward() averages the microbatches' own means: Note [Microbatch losses];
    # num_microbatch is the default, devices + 1, earlier chunks larger)
    parts = torch.arange(ids.shape[0]).tensor_split(min(len(pipe.devices) + 1, ids.shape[0]))
    ref = sum(oracle(inputs_embeds=oracle_embeds[h], attention_mask=mask[h], labels=labels[h]).loss
              for h in parts) / len(parts)
    ref.backward()
    assert_close(out.loss, ref, TOL)
    assert_close(embeds.grad, oracle_embeds.grad, 1e-4)


def train_steps(name, devices, is_async, steps=4, lr=1e-2):
    hf = MODELS[name]()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices=devices, optim_dtype=torch.float32,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=lr, eps=ADAM_EPS)  # see conftest
    losses = []
    data = [batch(seed=0, pad=True)] * steps  # one batch, so the loss must fall
    for ids, mask, labels in data:
        loss = pipe.forward_backward(input_kwargs=dict(input_ids=ids, attention_mask=mask, labels=labels))
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        losses.append(float(loss))
    pipe.synchronize()
    return hf, oracle, data, losses


@pytest.mark.parametrize("name", ["qwen3", "llama-tied-rope-scaling"])
def test_sync_training_matches_transformers_step_for_step(devices, name):
    hf, oracle, data, losses = train_steps(name, devices, is_async=False)
    opt = torch.optim.Adam(oracle.parameters(), lr=1e-2, eps=ADAM_EPS)
    expected = []
    for ids, mask, labels in data:
        opt.zero_grad()
        loss = hf_loss(oracle, ids, mask, labels)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert_close(torch.tensor(losses), torch.tensor(expected), 1e-4)
    assert expected[-1] < expected[0]
    ours = dict(hf.named_parameters())
    for n, q in oracle.named_parameters():
        # 4 Adam steps on gradients that differ by rounding: 4 * lr * GRAD_ERROR / ADAM_EPS = 4e-4
        assert_adam_weights_close(ours[n], q, steps=4, lr=1e-2)


def test_async_training_is_one_step_stale(devices):
    hf, oracle, data, losses = train_steps("qwen3", devices, is_async=True)
    opt = torch.optim.Adam(oracle.parameters(), lr=1e-2, eps=ADAM_EPS)
    previous = copy.deepcopy(oracle.state_dict())  # the weights one update old
    expected = []
    for ids, mask, labels in data:
        reader = copy.deepcopy(oracle)
        reader.load_state_dict(previous)
        loss = hf_loss(reader, ids, mask, labels)
        loss.backward()
        expected.append(loss.item())
        previous = copy.deepcopy(oracle.state_dict())
        for p, r in zip(oracle.parameters(), reader.parameters()):
            p.grad = r.grad
        opt.step()
        opt.zero_grad()
    assert_close(torch.tensor(losses), torch.tensor(expected), 1e-4)
    ours = dict(hf.named_parameters())
    for n, q in oracle.named_parameters():
        # 4 Adam steps on gradients that differ by rounding: 4 * lr * GRAD_ERROR / ADAM_EPS = 4e-4
        assert_adam_weights_close(ours[n], q, steps=4, lr=1e-2)


def test_save_pretrained_through_the_wrapper_has_the_trained_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    hf, _, _, _ = train_steps("qwen3-tied", "sim:2", is_async=True, steps=2)
    pipe_params = {n: p.detach().clone() for n, p in hf.named_parameters()}
    hf.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for n, p in again.named_parameters():
        assert torch.equal(p, pipe_params[n]), n


def test_preset_errors():
    hf = tiny_qwen3()
    with pytest.raises(NotImplementedError, match="no preset for Sequential"):
        wrap_model_to_roundpipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), use_sequential_preset=True)
    pipe = wrap_model_to_roundpipe(hf)
    with pytest.raises(TypeError, match="does not take"):
        pipe(torch.zeros(2, 4, dtype=torch.long), output_attentions=True)
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        pipe(torch.zeros(2, 4, dtype=torch.long), inputs_embeds=torch.zeros(2, 4, 32))
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        pipe(attention_mask=torch.ones(2, 4))
    mixed = tiny_qwen3()
    mixed.lm_head.to(torch.float64)
    with pytest.raises(ValueError, match="one parameter dtype"):
        wrap_model_to_roundpipe(mixed)


def grads_close(hf, oracle):
    ours = dict(hf.named_parameters())
    for n, q in oracle.named_parameters():
        assert ours[n].grad is not None, n
        assert_close(ours[n].grad, q.grad, 1e-4)


@pytest.mark.parametrize("name", ["qwen3", "llama-tied-rope-scaling"])
@pytest.mark.parametrize("kind", ["right", "left", "packed"])
@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_padding_and_packing_match_transformers_for_any_microbatch_count(devices, name, kind, microbatches):
    inputs = masked_batch(kind)
    if microbatches > inputs["input_ids"].shape[0]:
        pytest.skip("fewer rows than microbatches")
    hf = MODELS[name]()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices=devices,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=microbatches))
    loss, out = pipe.forward_backward(input_kwargs=dict(inputs, return_logits=True), return_outputs=True)
    pipe.synchronize()
    expected = oracle(**inputs)
    expected.loss.backward()
    assert_close(loss, expected.loss.detach(), TOL)
    assert_close(out.loss, loss, 0)  # the merged output carries the batch's loss, not a share's mean
    keep = inputs["attention_mask"].bool() if "attention_mask" in inputs else slice(None)
    assert_close(out.logits[keep], expected.logits.detach()[keep], 1e-4)
    grads_close(hf, oracle)


@pytest.mark.parametrize("kind", ["left", "packed"])
def test_forward_averages_the_microbatch_means_as_the_original(kind):
    """Note [Microbatch losses]: forward() merges the microbatches' losses by
    averaging them, each its own mean over its labelled tokens (transformers'
    on that microbatch), as the original does; so do its gradients."""
    inputs = masked_batch(kind)
    hf = tiny_qwen3()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices="sim:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = pipe(**inputs).loss
    loss.backward()
    pipe.synchronize()
    rows = inputs["input_ids"].shape[0]
    halves = [slice(0, (rows + 1) // 2), slice((rows + 1) // 2, rows)]
    expected = sum(oracle(**{k: v[h] for k, v in inputs.items()}).loss for h in halves) / 2
    expected.backward()
    assert_close(loss.detach(), expected.detach(), TOL)
    grads_close(hf, oracle)


def test_forward_with_num_items_in_batch_is_transformers_on_the_whole_batch():
    """With the count given, forward() gives what transformers computes on
    the whole batch with that count (the sum over labelled tokens divided by
    it), for 4 microbatches of a padded 8 x 32 batch."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 96, (8, 32), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate([32, 20, 5, 31, 12, 32, 1, 17]):
        mask[row, length:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    hf = tiny_qwen3()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices="sim:2", model_run_config=RoundPipeRunConfig(num_microbatch=4))
    with torch.no_grad():
        for items in (int((labels[:, 1:] != -100).sum()), 50):
            loss = pipe(**inputs, num_items_in_batch=items).loss
            expected = oracle(**inputs, num_items_in_batch=items).loss
            assert_close(loss, expected, TOL)


def test_a_loss_fn_gets_each_microbatchs_own_mean():
    """Issue 32: the original's idiom, loss_fn=lambda o, _: o.loss / N, trains
    on the mean of the microbatch means (each microbatch's output.loss its
    own mean, as transformers'), and forward_backward returns the sum of
    loss_fn's values; on a padded batch that differs from the token-weighted
    mean (test_microbatch_means_would_differ)."""
    inputs = masked_batch("left")
    hf = tiny_qwen3()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices="sim:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = pipe.forward_backward(input_kwargs=inputs, loss_fn=lambda o, _: o.loss / 2)
    pipe.synchronize()
    expected = sum(oracle(**{k: v[h] for k, v in inputs.items()}).loss / 2
                   for h in (slice(0, 2), slice(2, 4)))
    expected.backward()
    assert_close(loss, expected.detach(), TOL)
    grads_close(hf, oracle)


def test_microbatch_means_would_differ():
    """The padded batch tells a token-weighted loss from a mean of
    microbatch means (so the tests above can fail)."""
    inputs = masked_batch("left")
    hf = tiny_qwen3()
    with torch.no_grad():
        means = [hf(**{k: v[i:i + 2] for k, v in inputs.items()}).loss for i in (0, 2)]
        whole = hf(**inputs).loss
    assert abs(float(sum(means) / 2 - whole)) > 1e-3


def test_an_all_ones_mask_is_no_mask():
    hf = tiny_qwen3()
    pipe = wrap_model_to_roundpipe(hf, devices="sim:1", return_logits=True)
    ids, _, labels = batch()
    with torch.no_grad():
        plain = pipe(ids, labels=labels)
        ones = pipe(ids, attention_mask=torch.ones_like(ids), labels=labels)
        # position_ids 0..T-1 are the default: the same numbers too
        positions = pipe(ids, labels=labels, position_ids=torch.arange(ids.shape[1]).unsqueeze(0))
    for other in (ones, positions):
        assert torch.equal(other.loss, plain.loss)
        assert torch.equal(other.logits, plain.logits)


def test_num_items_in_batch_is_taken_as_given():
    """transformers' gradient-accumulation contract: the loss is the sum over
    labelled tokens divided by num_items_in_batch."""
    inputs = masked_batch("right")
    hf = tiny_qwen3()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices="sim:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = pipe.forward_backward(input_kwargs=dict(inputs, num_items_in_batch=100))
    with torch.no_grad():
        expected = oracle(**inputs, num_items_in_batch=100).loss
    assert_close(loss, expected, TOL)


def test_the_loss_keywords_ignore_index_and_shift_labels_are_transformers():
    """The original passes transformers' loss keywords through: a custom
    ignore_index, and pre-shifted labels (shift_labels, their last position
    ignored), give transformers' loss and gradients; a last position with a
    target is refused with the fix."""
    inputs = masked_batch("right")
    labels = inputs["labels"].masked_fill(inputs["labels"] == -100, -1)
    shifted = torch.cat([inputs["labels"][:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    for extra in (dict(labels=labels, ignore_index=-1), dict(shift_labels=shifted)):
        hf = tiny_qwen3()
        oracle = copy.deepcopy(hf)
        pipe = wrap_model_to_roundpipe(hf, devices="sim:2", model_run_config=RoundPipeRunConfig(num_microbatch=2))
        loss = pipe.forward_backward(input_kwargs=dict(inputs, **extra))
        pipe.synchronize()
        expected = oracle(**dict(inputs, **extra)).loss
        expected.backward()
        assert_close(loss, expected.detach(), TOL)
        grads_close(hf, oracle)
    with pytest.raises(ValueError, match="last position"):
        pipe.forward_backward(input_kwargs=dict(inputs, shift_labels=inputs["labels"]))


@pytest.mark.parametrize("kind", ["left", "packed"])
def test_the_router_load_balancing_loss_is_transformers(devices, kind):
    """output_router_logits: in one microbatch the loss and every gradient
    are transformers' (its load-balancing loss included); in two, each
    microbatch's router loss is its own, weighted by its labelled tokens
    (Note [Router load-balancing loss]), computed here from transformers'
    aux_loss of each half."""
    inputs = masked_batch(kind)
    rows = inputs["input_ids"].shape[0]
    for microbatches in (1, 2):
        if microbatches > rows:
            continue
        hf = tiny_qwen3_moe(output_router_logits=True, router_aux_loss_coef=0.5)
        oracle = copy.deepcopy(hf)
        pipe = wrap_model_to_roundpipe(hf, devices=devices,
                                       model_run_config=RoundPipeRunConfig(num_microbatch=microbatches))
        loss = pipe.forward_backward(input_kwargs=inputs)
        pipe.synchronize()
        if microbatches == 1:
            expected = oracle(**inputs).loss
        else:
            labels = inputs["labels"]
            count = lambda l: (l[:, 1:] != -100).sum().item()
            total, expected = count(labels), 0
            for part in (slice(0, rows // 2), slice(rows // 2, None)):
                res = oracle(**{k: v[part] for k, v in inputs.items()}, num_items_in_batch=total)
                expected = expected + res.loss - 0.5 * res.aux_loss * (1 - count(labels[part]) / total)
        expected.backward()
        assert_close(loss, expected.detach(), TOL)
        grads_close(hf, oracle)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_gpt_oss_keeps_packed_documents_apart(devices, microbatches):
    """Packed documents (position_ids restarting at 0) attend within their
    own document, attention sinks included. transformers' eager attention,
    its only one with GPT-OSS's sinks here, attends across them, so the
    oracle is transformers on each document alone: the sum of their
    token losses over the batch's labelled tokens, and its gradients."""
    from hf_models import tiny_gpt_oss

    inputs = masked_batch("packed")
    hf = tiny_gpt_oss()
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices=devices,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=microbatches))
    loss = pipe.forward_backward(input_kwargs=inputs)
    pipe.synchronize()
    labels, positions = inputs["labels"], inputs["position_ids"]
    total = (labels[:, 1:] != -100).sum().item()
    expected = 0
    for row in range(labels.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [positions.shape[1]]
        for a, b in zip(starts, starts[1:]):
            if b - a < 2:
                continue  # a one-token document has no label
            expected = expected + oracle(input_ids=inputs["input_ids"][row:row + 1, a:b],
                                         labels=labels[row:row + 1, a:b], num_items_in_batch=total).loss
    expected.backward()
    assert_close(loss, expected.detach(), TOL)
    grads_close(hf, oracle)

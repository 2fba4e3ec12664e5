"""HuggingFace Qwen3/Llama wrapped with the presets match transformers +
PyTorch: losses, logits, gradients, and training (sync: step for step;
async: against a one-step-delay oracle)."""
import copy

import pytest
import torch

import roundpipe
from roundpipe import CausalLMRoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe

from conftest import ADAM_EPS, assert_adam_weights_close, assert_close
from hf_models import MODELS, tiny_qwen3

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


def hf_microbatch_loss(model, ids, mask, labels, n):
    """The oracle for forward_backward: the sum of the microbatch mean losses."""
    total = 0
    for i, m, l in zip(ids.chunk(n), mask.chunk(n), labels.chunk(n)):
        total = total + model(input_ids=i, attention_mask=m, labels=l).loss
    return total


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
    expected = hf_microbatch_loss(oracle, ids, mask, labels, 2)
    expected.backward()
    assert_close(loss, expected.detach(), TOL)
    ours = dict(hf.named_parameters())
    for n, q in oracle.named_parameters():
        assert ours[n].grad is not None, n
        assert_close(ours[n].grad, q.grad, 1e-4)


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
        loss = hf_microbatch_loss(oracle, ids, mask, labels, 2)
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
        loss = hf_microbatch_loss(reader, ids, mask, labels, 2)
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
    with pytest.raises(ValueError, match="no preset for Sequential"):
        wrap_model_to_roundpipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), use_sequential_preset=True)
    pipe = wrap_model_to_roundpipe(hf)
    with pytest.raises(TypeError, match="does not take"):
        pipe(torch.zeros(2, 4, dtype=torch.long), position_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids"):
        pipe(attention_mask=torch.ones(2, 4))
    mixed = tiny_qwen3()
    mixed.lm_head.to(torch.float64)
    with pytest.raises(ValueError, match="one parameter dtype"):
        wrap_model_to_roundpipe(mixed)

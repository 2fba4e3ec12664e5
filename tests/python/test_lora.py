"""LoRA on the presets from peft (issue 18): a peft model (PeftModel, or
LoraModel's .model as the original's benchmark passes it) wraps into the
native layers; losses and the adapters' gradients match peft + transformers,
only the adapters get masters, training matches peft step for step, and
peft's own save_pretrained writes an adapter that peft loads back.

Tolerances: fp32 on both sides, the same products summed in another order:
TOL on losses, 1e-4 (scaled by the tensor's largest element) on gradients
and weights after Adam steps (conftest's assert_adam_weights_close)."""
import copy

import pytest
import torch

import roundpipe
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

from conftest import ADAM_EPS, assert_adam_weights_close, assert_close
from hf_models import tiny_qwen3

peft = pytest.importorskip("peft")

TOL = 2e-5


def padded_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    for row, length in enumerate([12, 7, 3, 10]):
        mask[row, length:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def lora_model(targets, rslora=False, seed=0, base=None, target_parameters=None):
    """A peft model (on tiny_qwen3, or `base`) with non-zero B (so that A's
    gradients show)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                             target_parameters=target_parameters)
    model = peft.get_peft_model(base if base is not None else tiny_qwen3(seed=seed), config)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def adapter_grads_close(ours, oracle, own_scale=False):
    """Each adapter's gradient to 1e-4 of max(1, its largest element), or
    (own_scale) of its largest element: the same bound at the gradient's
    scale, so that small gradients off by 1% show."""
    theirs = dict(oracle.named_parameters())
    for n, p in ours.named_parameters():
        if "lora_" in n:
            assert p.grad is not None, n
            ref = theirs[n].grad
            if own_scale:
                torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(), msg=n)
            else:
                assert_close(p.grad, ref, 1e-4)
        else:
            assert p.grad is None and not p.requires_grad, n


def check_against_peft(model, devices, oracle=None, own_scale=False, grain=None):
    """A peft model through RoundPipe (2 microbatches of a padded batch):
    masters for the adapters only, and peft's loss and adapter gradients
    (`oracle`'s: by default a copy of the model). Returns the names of the
    trainable parameters."""
    oracle = copy.deepcopy(model) if oracle is None else oracle
    pipe = wrap_model_to_roundpipe(model, devices=devices,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain))
    assert isinstance(pipe, roundpipe.CausalLMRoundPipe)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(list(pipe.optim_parameters())) == len(adapters) > 0  # masters for the adapters only
    inputs = padded_batch()
    loss = pipe.forward_backward(input_kwargs=inputs)
    pipe.synchronize()
    expected = oracle(**inputs).loss
    expected.backward()
    assert_close(loss, expected.detach(), TOL)
    adapter_grads_close(model, oracle, own_scale)
    return adapters


@pytest.mark.parametrize("targets,rslora", [("all-linear", False), (["q_proj", "v_proj", "down_proj"], True)])
def test_losses_and_adapter_gradients_match_peft(devices, targets, rslora):
    check_against_peft(lora_model(targets, rslora), devices)


def test_thin_checkpoints_train_as_peft(devices):
    """recompute_grain="layer_from_stage" (Note [Thin checkpoints]): the host
    keeps each backward stage's input only; peft's loss and gradients."""
    check_against_peft(lora_model("all-linear", False), devices, grain="layer_from_stage")


def test_the_originals_form_lora_model_dot_model_trains_like_peft_and_saves_a_peft_adapter(tmp_path):
    """As the original's benchmark: LoraModel(hf, config, "default").model;
    sync Adam steps against torch Adam on peft's model, then peft's own
    save_pretrained/from_pretrained round trip."""
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    wrapper = peft.get_peft_model(tiny_qwen3(), config)
    hf = wrapper.base_model.model  # what LoraModel(hf, config, "default").model is
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    oracle = copy.deepcopy(hf)
    pipe = wrap_model_to_roundpipe(hf, devices="sim:2", use_sequential_preset=True,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=1e-2, eps=ADAM_EPS)
    ref_opt = torch.optim.Adam([p for p in oracle.parameters() if p.requires_grad], lr=1e-2, eps=ADAM_EPS)
    inputs = padded_batch()
    steps = 3
    for _ in range(steps):
        loss = pipe.forward_backward(input_kwargs=inputs)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        expected = oracle(**inputs).loss
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close(loss, expected.detach(), 1e-4)
    pipe.synchronize()
    theirs = dict(oracle.named_parameters())
    for n, p in hf.named_parameters():
        if "lora_" in n:
            assert_adam_weights_close(p, theirs[n], steps=steps, lr=1e-2)
        else:
            assert torch.equal(p, theirs[n]), n  # frozen
    # peft's own adapter files (of the trained tensors: the wrapper holds
    # them), loaded by peft on a fresh base model.
    wrapper.save_pretrained(str(tmp_path))
    assert (tmp_path / "adapter_config.json").exists() and (tmp_path / "adapter_model.safetensors").exists()
    reloaded = peft.PeftModel.from_pretrained(tiny_qwen3(), str(tmp_path))
    with torch.no_grad():
        trained = hf(**inputs).loss
        assert_close(reloaded(**inputs).loss, trained, 1e-6)
        assert abs(float(tiny_qwen3()(**inputs).loss) - float(trained)) > 1e-3, "the adapter changed nothing"


def test_what_the_preset_cannot_compute_is_refused():
    dora = peft.get_peft_model(tiny_qwen3(), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(NotImplementedError, match="DoRA"):
        wrap_model_to_roundpipe(dora, devices="sim:1")
    some = peft.get_peft_model(tiny_qwen3(), peft.LoraConfig(r=2, target_modules=["q_proj"], layers_to_transform=[0]))
    with pytest.raises(NotImplementedError, match="layers_to_transform"):
        wrap_model_to_roundpipe(some, devices="sim:1")
    head = peft.get_peft_model(tiny_qwen3(), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(NotImplementedError, match="lm_head"):
        wrap_model_to_roundpipe(head, devices="sim:1")


@pytest.mark.parametrize("family,modules,experts", [
    ("qwen3-moe", ["q_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    ("qwen3-moe", ["q_proj"], ["experts.down_proj"]),
    # peft maps these onto the experts: gate_up_proj at twice the rank and alpha
    ("qwen3-moe", ["q_proj", "gate_proj", "up_proj", "down_proj"], None),
    # GPT-OSS's experts are stored [E, in, out] (peft: is_transposed)
    ("gpt-oss", ["q_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
])
def test_lora_on_the_experts_matches_peft(devices, family, modules, experts):
    """peft's LoRA on the stacked expert weights of Qwen3-MoE and GPT-OSS
    (target_parameters, or the projections peft maps onto them; Note [Expert
    LoRA]) with the attention's q_proj: loss and every adapter gradient as
    peft's."""
    from hf_models import MODELS

    adapters = check_against_peft(lora_model(modules, base=MODELS[family](), target_parameters=experts), devices)
    sparse = 3 if family == "gpt-oss" else 2  # layers with experts
    assert sum(".experts." in n for n in adapters) == 2 * sparse * len(experts or [1, 2])  # A and B

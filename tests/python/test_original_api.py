"""The original library's RoundPipe, optimizer and run-config API (its
ORIGINAL_API facts) on our package: names, signatures, defaults, semantics."""

import pytest
import roundpipe
import torch
from conftest import make_model
from roundpipe import RoundPipe


def test_model_attributes_and_the_forwarding_target(devices):
    model = make_model()
    model.note = "seq"
    pipe = RoundPipe(model, devices=devices, optim_dtype=torch.float32)
    assert pipe.model is model and pipe.original_model is model
    assert pipe.optim_dtype == torch.float32
    assert len(pipe.layers) == len(model) and pipe.layers[0] is model[0]
    target = torch.nn.Linear(2, 2)
    target.note = "original"
    pipe.set_original_model(target)
    assert pipe.original_model is target
    assert pipe.note == "original"  # reads: the original model first
    pipe.note = "both"  # writes and deletes: to both
    assert (model.note, target.note) == ("both", "both")
    del pipe.note
    assert not hasattr(model, "note") and not hasattr(target, "note")
    with pytest.raises(AttributeError):
        del pipe.no_such_attribute
    pipe.written_later = 7  # a new attribute reaches the models too (issue 32)
    assert (pipe.written_later, model.written_later, target.written_later) == (7, 7, 7)


def test_a_parameter_in_two_live_roundpipes_is_an_error():
    shared = torch.nn.Linear(4, 4)
    first = RoundPipe(torch.nn.Sequential(shared, torch.nn.Tanh()), devices="sim:1")
    with pytest.raises(ValueError, match="already belongs to another live RoundPipe"):
        RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4), shared), devices="sim:1")
    del first
    import gc
    gc.collect()
    RoundPipe(torch.nn.Sequential(shared), devices="sim:1")  # free once the first is gone


def test_the_originals_import_paths():
    from roundpipe.batch import RoundPipePackedData
    from roundpipe.models import SUPPORTED_MODELS
    from roundpipe.roundpipe import AutoRoundPipe
    from roundpipe.timer import ModelTimer

    assert AutoRoundPipe is roundpipe.AutoRoundPipe
    assert RoundPipePackedData is roundpipe.PackedMicrobatches
    assert set(SUPPORTED_MODELS) >= {"Qwen3ForCausalLM", "LlamaForCausalLM"}
    assert ModelTimer.SMOOTH_RATE == 0.9




def test_the_default_name_is_the_call_site():
    pipe = RoundPipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), devices="sim:1")
    assert pipe.name.startswith("test_original_api.py:"), pipe.name
    assert RoundPipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), name="mine").name == "mine"


def test_a_step_functions_gradients_reuse_their_memory_unless_held(devices):
    """Note [Gradient buffers kept across steps], through Python: float16
    gradients cast into the float32 masters' .grad reuse the memory of the
    step before once torch's zero_grad() set it to None, never memory the
    caller still holds; a .grad not zeroed takes the next gradient in place.
    No step updates the weights, so one batch gives one gradient (up to the
    order in which the devices' float16 parts were summed: 2 ** -10 of
    each)."""
    pipe = RoundPipe(make_model(dtype=torch.float16), devices=devices, optim_dtype=torch.float32)
    master = next(iter(pipe.optim_parameters()))
    x, y = torch.randn(6, 4).half(), torch.randn(6, 3).half()
    seen = []

    def same(a, b):
        return torch.allclose(a, b, rtol=4e-3, atol=4e-3 * b.abs().max().item())

    def run(keep=False, zero=True):
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).float().mean())

        def step():
            seen.append((master.grad.data_ptr(), master.grad.clone(), master.grad if keep else None))
            if zero:
                for p in pipe.optim_parameters():
                    p.grad = None
        pipe.step(step, is_async=False)

    run()
    run()
    assert seen[1][0] == seen[0][0]  # the memory of the step before
    assert same(seen[1][1], seen[0][1]) and seen[0][1].abs().sum() > 0
    run(keep=True)  # the caller keeps this .grad
    run()
    assert seen[3][0] != seen[2][0] and torch.equal(seen[2][2], seen[2][1])
    run(zero=False)
    run()
    assert same(seen[5][1], seen[4][1] + seen[0][1])  # added in place

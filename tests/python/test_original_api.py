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

"""The original's run-config page: RoundPipeRunConfig fields resolved per call,
then per model, then by default."""
import copy

import torch
from conftest import assert_close, make_model
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


def test_merge_output_true_is_automatic_and_beats_a_model_level_false(devices):
    model = make_model()
    plain = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=False))
    x = torch.randn(6, 4)
    with torch.no_grad():
        packed = pipe(x)
        merged = pipe(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=True))
        expected = plain(x)
    assert isinstance(packed, list) and len(packed) == 2  # the original's list subclass
    assert packed.synchronize() is packed and len(packed.transfer_event) == 2
    assert_close(torch.cat(list(packed)), expected)
    assert_close(merged, expected)


def test_each_field_is_the_calls_else_the_models_else_the_default(devices):
    """Per field: the call's value if set, else the model's, else the
    built-in default (num_microbatch = devices + 1, output on the CPU);
    num_microbatch=1 runs the batch whole."""
    seen = []

    class Rows(torch.nn.Module):
        def forward(self, x):
            seen.append(x.shape[0])
            return x

    model = torch.nn.Sequential(Rows(), torch.nn.Linear(4, 2))
    pipe = RoundPipe(model, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x = torch.randn(12, 4)
    with torch.no_grad():
        pipe(x)
        assert sorted(seen) == [4, 4, 4]  # the model's
        seen.clear()
        out = pipe(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1))
        assert seen == [12] and out.device.type == "cpu"  # the call's; the default device
        seen.clear()
    plain = RoundPipe(torch.nn.Sequential(Rows(), torch.nn.Linear(4, 2)), devices=devices)
    with torch.no_grad():
        plain(x)
    assert len(seen) == len(plain.devices) + 1  # the default
    # A call's requires_grad=False beats grad mode; the model's grain holds
    # unless the call sets one.
    out = pipe(x, roundpipe_run_config=RoundPipeRunConfig(requires_grad=False))
    assert not out.requires_grad
    layered = RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)),
                        devices=devices, model_run_config=RoundPipeRunConfig(recompute_grain="layer"))
    reference = copy.deepcopy(layered.original_model)
    layered(x, roundpipe_run_config=RoundPipeRunConfig(recompute_grain="stage")).square().sum().backward()
    layered.synchronize()
    reference(x).square().sum().backward()
    for p, q in zip(layered.original_model.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, 1e-5)


def test_the_execute_plan_is_copied():
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2)]
    config = RoundPipeRunConfig(execute_plan=plan)
    plan.fwd_plan.append(range(2, 3))
    assert config.execute_plan is not plan and config.execute_plan.fwd_plan == [range(0, 2)]


def test_merge_output_false_packs_each_leaf_of_a_tuple_output(devices):
    """As the original: a tuple output with merge_output=False is a tuple of
    packed values, one per leaf (each a list over the microbatches); a next
    RoundPipe takes them anywhere in its arguments, microbatch i taking
    element i of each, and gradients flow back through both."""
    torch.manual_seed(0)

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.a(x), self.b(x)

    class Join(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.out = torch.nn.Linear(5, 1)

        def forward(self, a, b):
            return self.out(torch.cat([a, b], -1))

    split, join = Split(), Join()
    ref_split, ref_join = copy.deepcopy(split), copy.deepcopy(join)
    first = RoundPipe(split, devices=devices,
                      model_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=False))
    second = RoundPipe(join, devices=devices, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x = torch.randn(6, 4)
    a, b = first(x)
    assert isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2
    assert [t.shape for t in a] == [torch.Size([3, 3])] * 2 and b[1].shape == torch.Size([3, 2])
    out = second(a, b)
    out.sum().backward()
    first.synchronize()
    second.synchronize()
    expected = ref_join(*ref_split(x))
    expected.sum().backward()
    assert_close(out.detach(), expected.detach())
    for p, q in zip(list(split.parameters()) + list(join.parameters()),
                    list(ref_split.parameters()) + list(ref_join.parameters())):
        assert_close(p.grad, q.grad)

"""The original's execute-plan page: ModelExecutePlan built the original way,
check_valid, auto(run_type, *models, ...), and automatic plans under a
memory limit."""

import copy

import pytest
import torch
from conftest import assert_close, make_model, mse
from roundpipe import (
    ModelExecutePlan,
    RoundPipe,
    RoundPipeRunConfig,
)


def test_auto_plan_fits_a_memory_limit(capsys):
    model = make_model(dim=64, blocks=6)  # a block: ~33k floats = 130 KiB
    pipe = RoundPipe(model, devices="sim:2")
    block_bytes = sum(p.numel() * 4 for p in model[1].parameters())
    # A backward stage holds at most one block: one needs 3 blocks' bytes
    # (parameters, gradients, the next stage's parameters), two need 6, and
    # until activations are measured the plan keeps half the limit for them.
    limit_gib = 7 * block_bytes / 2**30
    plan = ModelExecutePlan.auto("fused", pipe, model_memory_limit=limit_gib, verbose=True)
    plan.validate(len(model), fused=True)
    # (layers 1..6 are the blocks; the embedding and head are small)
    assert all(sum(1 for layer in r if 1 <= layer <= 6) <= 1 for r in plan.bwd_plan[1:]), plan
    assert "predicted" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="smallest feasible limit"):
        ModelExecutePlan.auto("fused", pipe, model_memory_limit=limit_gib / 10)
    # a model-level limit is the default plan's
    limited = RoundPipe(make_model(dim=64, blocks=6), devices="sim:2", model_memory_limit=limit_gib)
    loss = limited.forward_backward(input_args=(torch.randn(6, 4),), label=torch.randn(6, 3), loss_fn=mse)
    assert torch.isfinite(loss)


def test_model_execute_plan_the_original_way():
    from roundpipe import ModelExecutePlan

    plan = ModelExecutePlan()  # empty, then filled in
    assert plan.fwd_plan == [] and plan.bwd_plan == []
    plan.fwd_plan = [range(0, 2), range(2, 6)]
    plan.check_valid(6, "infer")
    plan.bwd_plan = [range(3, 6), range(0, 3)]
    plan.check_valid(6, "train")
    with pytest.raises(ValueError):
        plan.check_valid(6, "fused")  # the forward must stop before bwd_plan[0]
    with pytest.raises(ValueError):
        ModelExecutePlan([range(0, 2)], []).check_valid(6, "infer")  # layers 2..5 uncovered
    with pytest.raises(ValueError, match="run_type"):
        plan.check_valid(6, "eval")

    first = RoundPipe(make_model(), devices="sim:2")
    second = RoundPipe(make_model(), devices="sim:2")
    assert ModelExecutePlan.auto("fused") == []
    one = ModelExecutePlan.auto("fused", first, upper_threshold=1.2)
    one.check_valid(first.num_layers, "fused")
    infer = ModelExecutePlan.auto("infer", first)
    assert infer.bwd_plan == []
    infer.check_valid(first.num_layers, "infer")
    both = ModelExecutePlan.auto("train", first, second, min_stages=2)
    assert len(both) == 2
    for p, m in zip(both, (first, second)):
        p.check_valid(m.num_layers, "train")
        assert len(p.fwd_plan) + len(p.bwd_plan) >= 2


def test_fused_plans_of_a_chain_give_every_model_but_the_last_a_training_plan():
    """Issue 32, as the original: auto("fused", m1, m2) plans m1 for
    forward() with grad (a full forward plan) and m2 for forward_backward;
    the chain then trains with those plans as without them."""
    torch.manual_seed(0)
    nn = torch.nn
    model1 = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    model2 = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    ref1, ref2 = copy.deepcopy(model1), copy.deepcopy(model2)
    first = RoundPipe(model1, devices="sim:2")
    second = RoundPipe(model2, devices="sim:2")
    p1, p2 = ModelExecutePlan.auto("fused", first, second)
    p1.check_valid(first.num_layers, "train")
    p2.check_valid(second.num_layers, "fused")
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    hidden = first(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=p1))
    loss = second.forward_backward(input_args=(hidden,), label=y, loss_fn=mse,
                                   run_config=RoundPipeRunConfig(execute_plan=p2))
    first.synchronize()
    second.synchronize()
    n = second.model_run_config.num_microbatch or len(second.devices) + 1
    expected = sum(mse(ref2(ref1(xs)), ys) for xs, ys in zip(x.tensor_split(n), y.tensor_split(n)))
    expected.backward()
    assert_close(loss, expected.detach())
    for p, q in zip(list(model1.parameters()) + list(model2.parameters()),
                    list(ref1.parameters()) + list(ref2.parameters())):
        assert_close(p.grad, q.grad)

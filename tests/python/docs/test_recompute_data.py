"""The original's recompute-data page: save_for_recompute, doing_recompute and
get_recompute_data replay a forward's random choices in the recompute."""
import pytest
import torch
from conftest import assert_close
from roundpipe import (
    ModelExecutePlan,
    RoundPipe,
    RoundPipeRunConfig,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)
from torch import nn


class RandomRouting(nn.Module):
    """Random, host-syncing work that a recompute must replay, not redo."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.recomputes = 0

    def forward(self, x):
        if doing_recompute():
            (keep,) = get_recompute_data()
            type(self).seen_recompute = True
        else:
            keep = torch.randperm(x.shape[0], device=x.device)[: x.shape[0] // 2]
            save_for_recompute(keep)
        out = self.lin(x)
        return out.index_fill(0, keep, 0.0)


def test_recompute_helpers_replay_saved_data(devices):
    RandomRouting.seen_recompute = False
    model = nn.Sequential(RandomRouting(), nn.Linear(4, 4), nn.Linear(4, 1))
    pipe = RoundPipe(model, devices=devices,
                     model_run_config=RoundPipeRunConfig(preserve_rng_state=False, num_microbatch=1))
    x = torch.randn(6, 4)
    loss = pipe.forward_backward(input_args=(x,), label=None, loss_fn=lambda o, _: o.sum(),
                                 run_config=RoundPipeRunConfig(execute_plan=ModelExecutePlan(
                                     [range(0, 2)], [range(2, 3), range(0, 2)])))
    pipe.synchronize()
    assert RandomRouting.seen_recompute
    # the gradient of the zeroed rows' bias is consistent with the forward:
    # d(sum)/d(bias of layer 0) = (rows kept) * (W1^T W2^T), which needs the
    # same `keep` in forward and recompute
    w = model[2].weight @ model[1].weight
    kept_rows = 6 - 3
    assert_close(model[0].lin.bias.grad, (w.squeeze(0) * kept_rows).detach(), 1e-5)
    assert torch.isfinite(loss)


def test_outside_a_layer_save_is_a_no_op_and_get_raises():
    """Outside a RoundPipe layer: save_for_recompute does nothing,
    doing_recompute() is False, get_recompute_data() raises (an
    AssertionError, as the original's, and a RuntimeError)."""
    assert save_for_recompute(torch.ones(1), "tag") is None
    assert doing_recompute() is False
    with pytest.raises(AssertionError):
        get_recompute_data()
    with pytest.raises(RuntimeError, match="only valid during a recompute"):
        get_recompute_data()

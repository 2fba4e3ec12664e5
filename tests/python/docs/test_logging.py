"""The original's logging page: ModelTimer.VERBOSE logs the measured layers and
the plan."""

import torch
from conftest import make_model, mse
from roundpipe import RoundPipe


def test_the_timer_switch_logs_the_measured_layers(capfd):
    from roundpipe.timer import ModelTimer

    assert ModelTimer.VERBOSE is False and ModelTimer.SMOOTH_RATE == 0.9
    ModelTimer.VERBOSE = True
    try:
        pipe = RoundPipe(make_model(), devices="sim:1")
    finally:
        ModelTimer.VERBOSE = False
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    for _ in range(4):
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    pipe.synchronize()
    err = capfd.readouterr().err
    assert "plan for" in err and "forward" in err, err
    # The original's per-layer lines (issue 32): each measurement of a
    # layer's forward, recompute and backward, its time and the estimate.
    import re
    lines = re.findall(r"^Layer (\d+) (fwd|re|bwd)  new record: ([0-9.]+) ms  new estimate: ([0-9.]+) ms$",
                       err, re.MULTILINE)
    assert lines, err
    assert {kind for _, kind, _, _ in lines} >= {"fwd", "bwd"}, err
    assert {int(layer) for layer, _, _, _ in lines} == set(range(pipe.num_layers)), err

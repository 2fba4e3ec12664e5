"""The original's overview page (docs/UserGuide/overview.en.md): layers are
an nn.Sequential's children; forward and backward may be partitioned
differently (its 12-layer example), every layer's forward recomputed in
backward; the typical loop forward_backward +
step(lambda: (optimizer.step(), optimizer.zero_grad())); a batch of 12 in 3
microbatches of samples 0-3, 4-7, 8-11, the returned loss their sum, the
gradients the sum of theirs, and loss_fn / num_microbatch the mean; all
against plain PyTorch.

Tolerances: fp32 on both sides, the same products summed in another order
(microbatches, matmul blocking): 1e-5 relative (conftest's assert_close);
SGD moves a weight by lr * gradient, so weights after k steps differ by at
most k * lr * GRAD_ERROR (plus fp32 rounding of the weights, < 1e-6)."""
import copy

import torch
import torch.nn as nn
from conftest import GRAD_ERROR, assert_close
from roundpipe import ModelExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig


def make_net(layers=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), *[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers - 2)],
                         nn.Linear(8, 3))


def test_the_typical_training_loop_trains_as_plain_pytorch_one_step_stale():
    """The page's loop, with its asynchronous step: each iteration runs on
    the weights one update old (RoundPipe's asynchronous optimizer)."""
    net = make_net()
    plain = copy.deepcopy(net)
    model = RoundPipe(net)
    with OptimizerCtx():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.MSELoss()
    my_loss_fn = criterion
    torch.manual_seed(1)
    dataloader = [(torch.randn(6, 4), torch.randn(6, 3)) for _ in range(3)]

    losses = []
    for data, labels in dataloader:
        loss = model.forward_backward(
            input_args=(data,),
            label=labels,
            loss_fn=my_loss_fn,
        )
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        losses.append(loss)
    model.synchronize()

    n = len(model.devices) + 1  # the default num_microbatch
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    previous = copy.deepcopy(plain.state_dict())  # the weights one update old
    for (data, labels), loss in zip(dataloader, losses):
        reader = copy.deepcopy(plain)
        reader.load_state_dict(previous)
        expected = sum(criterion(reader(x), y) for x, y in zip(data.tensor_split(n), labels.tensor_split(n)))
        expected.backward()
        assert_close(loss, expected.detach())
        previous = copy.deepcopy(plain.state_dict())
        for p, r in zip(plain.parameters(), reader.parameters()):
            p.grad = r.grad
        plain_opt.step()
        plain_opt.zero_grad()
    for p, q in zip(net.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=3 * 0.1 * GRAD_ERROR + 1e-6)


def test_a_batch_of_12_in_3_microbatches_sums_their_losses_and_gradients():
    net = make_net()
    plain = copy.deepcopy(net)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    criterion = nn.MSELoss()
    data = torch.randn(12, 4)
    labels = torch.arange(12.0).view(12, 1).expand(12, 3).contiguous()
    seen = []

    def my_loss_fn(outputs, labels):
        seen.append(labels[:, 0].tolist())
        return criterion(outputs, labels)

    loss = model.forward_backward(input_args=(data,), label=labels, loss_fn=my_loss_fn)
    model.synchronize()
    # microbatch i: samples 4i .. 4i+3
    assert sorted(seen) == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    expected = sum(criterion(plain(data[i:i + 4]), labels[i:i + 4]) for i in (0, 4, 8))
    expected.backward()
    assert_close(loss, expected.detach())
    for p, q in zip(net.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)

    # Dividing by num_microbatch inside loss_fn: the mean, the same as the
    # loss over the entire batch backpropagated once.
    for p in net.parameters():
        p.grad = None
    plain.zero_grad()
    num_microbatch = 3
    loss = model.forward_backward(input_args=(data,), label=labels,
                                  loss_fn=lambda outputs, labels: criterion(outputs, labels) / num_microbatch)
    model.synchronize()
    whole = criterion(plain(data), labels)
    whole.backward()
    assert_close(loss, whole.detach())
    for p, q in zip(net.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


def test_a_12_layer_model_with_the_pages_asymmetric_partition():
    """Each child of the nn.Sequential is a layer; forward stages of 3
    layers, backward stages of 1 (full recomputation), as plain PyTorch."""
    net = make_net(12)
    plain = copy.deepcopy(net)
    calls = [0] * 12
    for i, layer in enumerate(net):
        layer.register_forward_hook(lambda m, args, out, i=i: calls.__setitem__(i, calls[i] + 1))
    model = RoundPipe(net)
    assert model.num_layers == 12
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    plan.bwd_plan = [range(i, i + 1) for i in reversed(range(12))]
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    out = model(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan))
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    model.synchronize()
    n = len(model.devices) + 1
    # full activation recomputation: every layer's forward runs again in backward
    assert calls == [2 * n] * 12
    expected = torch.cat([plain(part) for part in x.tensor_split(n)])
    assert_close(out.detach(), expected.detach())
    nn.functional.mse_loss(expected, y).backward()
    for p, q in zip(net.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)

"""The original's run-config API page (docs/API/run_config.en.md), its
snippets as written: the split_input spec ((TensorChunkSpec(0),
_Replicate), None) and custom_split(images, masks); the split_label spec
(_Replicate, TensorChunkSpec(1), _Replicate) for a (scalar, (3, 12, 4),
int) label and custom_split_label(targets, weights); the _CustomReducer
sum_reducer, custom_merge of out.logits and merge_output=False; the two
4-layer ModelExecutePlans; ModelExecutePlan.auto for one model and for two;
the defaults. Against plain PyTorch on the same microbatches.

Tolerances: fp32 on both sides, the same products summed in another order:
1e-5 relative (conftest's assert_close)."""
import collections
import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_close
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, StageError
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen = []

    def forward(self, images, masks):
        self.seen.append((images.shape[0], masks.shape[0]))
        return self.lin(images) * masks.sum()


def test_split_input_spec_and_custom_split():
    torch.manual_seed(0)
    layer = TwoInputs()
    plain = copy.deepcopy(layer)
    model = RoundPipe(layer)
    images, masks = torch.randn(12, 4), torch.rand(12, 2)  # 12 rows: chunk() gives n chunks for n = 2, 3, 4

    # First positional arg split along batch dim, second replicated
    config = RoundPipeRunConfig(
        split_input=(
            (TensorChunkSpec(0), _Replicate),  # args spec
            None,                               # kwargs spec (auto-infer)
        ),
        num_microbatch=3,
    )
    with torch.no_grad():
        out = model(images, masks, roundpipe_run_config=config)
    assert sorted(layer.seen) == [(4, 12)] * 3
    assert_close(out, torch.cat([plain(part, masks) for part in images.chunk(3)]).detach())

    def custom_split(args, kwargs, num_microbatch):
        images, masks = args
        chunks_images = images.chunk(num_microbatch)
        chunks_masks = masks.chunk(num_microbatch)
        args_list = [(img, mask) for img, mask in zip(chunks_images, chunks_masks)]
        kwargs_list = [kwargs] * num_microbatch  # replicate kwargs
        return args_list, kwargs_list

    config = RoundPipeRunConfig(split_input=custom_split)
    layer.seen.clear()
    with torch.no_grad():
        out = model(images, masks, roundpipe_run_config=config)
    n = len(model.devices) + 1  # the default num_microbatch
    assert sorted(layer.seen) == sorted((c.shape[0], c.shape[0]) for c in images.chunk(n))
    expected = torch.cat([plain(a, b) for a, b in zip(images.chunk(n), masks.chunk(n))])
    assert_close(out, expected.detach())


def test_split_label_spec_and_custom_split_label():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4))
    plain = copy.deepcopy(seq)
    model = RoundPipe(seq)
    x = torch.randn(12, 4)

    # Label is (scalar tensor, tensor of shape (3, 12, 4), integer)
    # The second tensor needs to be split along dimension 1
    config = RoundPipeRunConfig(
        split_label=(_Replicate, TensorChunkSpec(1), _Replicate)
    )
    label = (torch.tensor(0.5), torch.randn(3, 12, 4), 2)
    seen = []

    def loss_fn(out, lbl):
        scalar, target, k = lbl
        seen.append((scalar.item(), tuple(target.shape), k))
        return ((out - target.mean(0)) ** 2).sum() * scalar * k

    n = len(model.devices) + 1
    loss = model.forward_backward(input_args=(x,), label=label, loss_fn=loss_fn, run_config=config)
    model.synchronize()
    rows = [c.shape[0] for c in x.tensor_split(n)]
    assert sorted(seen) == sorted((0.5, (3, r, 4), 2) for r in rows)
    expected = sum(((plain(a) - t.mean(0)) ** 2).sum() * 0.5 * 2
                   for a, t in zip(x.tensor_split(n), label[1].tensor_split(n, dim=1)))
    expected.backward()
    assert_close(loss, expected.detach())
    for p, q in zip(seq.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)

    def custom_split_label(label, num_microbatch):
        targets, weights = label
        chunks_targets = targets.chunk(num_microbatch)
        chunks_weights = weights.chunk(num_microbatch)
        return [(t, w) for t, w in zip(chunks_targets, chunks_weights)]

    config = RoundPipeRunConfig(split_label=custom_split_label)
    targets, weights = torch.randn(12, 4), torch.rand(12, 1)
    loss = model.forward_backward(input_args=(x,), label=(targets, weights), run_config=config,
                                  loss_fn=lambda out, lbl: (((out - lbl[0]) ** 2) * lbl[1]).sum())
    model.synchronize()
    expected = (((plain(x) - targets) ** 2) * weights).sum()
    assert_close(loss, expected.detach())


Output = collections.namedtuple("Output", ["logits"])


class WithLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return Output(self.lin(x))


def test_merge_specs_custom_merge_and_no_merging():
    torch.manual_seed(0)
    layer = WithLogits()
    plain = copy.deepcopy(layer)
    x = torch.randn(6, 4)
    expected = plain(x).logits.detach()

    sum_reducer = _CustomReducer(torch.tensor(0.0), lambda x, y: x + y)
    summed = RoundPipe(nn.Sequential(nn.Linear(4, 3), _RowSum()))
    with torch.no_grad():
        total = summed(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=sum_reducer, num_microbatch=3))
        assert_close(total, summed.model(x).sum())  # the microbatch sums, summed

    def custom_merge(outputs):
        # outputs is a list where each element is one microbatch's model output
        logits = torch.cat([out.logits for out in outputs], dim=0)
        return logits

    config = RoundPipeRunConfig(merge_output=custom_merge)
    model = RoundPipe(layer)
    with torch.no_grad():
        logits = model(x, roundpipe_run_config=config)
        assert isinstance(logits, torch.Tensor)
        assert_close(logits, expected)
        # No merging: each leaf is a list over the microbatches
        packed = model(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False, num_microbatch=2))
    assert isinstance(packed, Output) and isinstance(packed.logits, list)
    parts = packed.logits.synchronize()
    assert len(parts) == 2
    assert_close(torch.cat([p.cpu() for p in parts]), expected)


class _RowSum(nn.Module):
    def forward(self, h):
        return h.sum()


def plain_fused_loss(plain, x, y, n):
    return sum(nn.functional.mse_loss(plain(a), b) for a, b in zip(x.tensor_split(n), y.tensor_split(n)))


def four_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))


def test_the_pages_two_4_layer_plans():
    seq = four_layers()
    plain = copy.deepcopy(seq)
    model = RoundPipe(seq)
    n = len(model.devices) + 1
    x, y = torch.randn(6, 4), torch.randn(6, 3)

    # with the forward method
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(2, 4)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    out = model(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan))
    nn.functional.mse_loss(out, y).backward()
    model.synchronize()
    expected = torch.cat([plain(a) for a in x.tensor_split(n)])
    nn.functional.mse_loss(expected, y).backward()
    assert_close(out.detach(), expected.detach())
    for p, q in zip(seq.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)

    # with forward_backward: the last stage is not recomputed
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 3)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    for p in list(seq.parameters()) + list(plain.parameters()):
        p.grad = None
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss,
                                  run_config=RoundPipeRunConfig(execute_plan=plan))
    model.synchronize()
    expected = plain_fused_loss(plain, x, y, n)
    expected.backward()
    assert_close(loss, expected.detach())
    for p, q in zip(seq.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


def test_an_automatic_plan_for_one_model():
    seq = four_layers()
    plain = copy.deepcopy(seq)
    model = RoundPipe(seq)
    data, labels, loss_fn = torch.randn(6, 4), torch.randn(6, 3), nn.functional.mse_loss

    # Auto-generate a training plan
    plan = ModelExecutePlan.auto("fused", model)

    # Use the generated plan
    loss = model.forward_backward(
        input_args=(data,),
        label=labels,
        loss_fn=loss_fn,
        run_config=RoundPipeRunConfig(execute_plan=plan),
    )
    model.synchronize()
    expected = plain_fused_loss(plain, data, labels, len(model.devices) + 1)
    expected.backward()
    assert_close(loss, expected.detach())
    for p, q in zip(seq.parameters(), plain.parameters()):
        assert_close(p.grad, q.grad)


def test_co_optimized_plans_for_two_models_as_the_page_calls_them():
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    plain1, plain2 = copy.deepcopy(first), copy.deepcopy(second)
    model1, model2 = RoundPipe(first), RoundPipe(second)
    data1, labels, loss_fn = torch.randn(6, 4), torch.randn(6, 3), nn.functional.mse_loss

    # Multi-model co-optimized planning
    plan1, plan2 = ModelExecutePlan.auto("fused", model1, model2)
    # The page calls model1.forward(input_args=(data1,), run_config=...),
    # which is not forward's signature on either package (the model page's:
    # forward(*args, roundpipe_run_config=None, **kwargs)): the keywords go
    # to layer 0, which refuses them. As the model page writes it:
    with pytest.raises(StageError, match="input_args"):
        model1.forward(input_args=(data1,),
                       run_config=RoundPipeRunConfig(execute_plan=plan1, merge_output=False))
    output1 = model1.forward(
        data1, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan1, merge_output=False))
    loss = model2.forward_backward(
        input_args=(output1,),
        label=labels,
        loss_fn=loss_fn,
        run_config=RoundPipeRunConfig(execute_plan=plan2),
    )
    model1.synchronize()
    model2.synchronize()
    n = len(model2.devices) + 1
    expected = sum(loss_fn(plain2(plain1(a)), b) for a, b in zip(data1.tensor_split(n), labels.tensor_split(n)))
    assert_close(loss, expected.detach())


def test_the_defaults():
    config = RoundPipeRunConfig()
    assert all(getattr(config, f) is None for f in (
        "requires_grad", "output_device", "preserve_rng_state", "recompute_grain", "num_microbatch",
        "split_input", "split_label", "merge_output", "execute_plan"))
    rows = []
    seq = nn.Sequential(nn.Linear(4, 3))
    seq[0].register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    model = RoundPipe(seq)
    x = torch.randn(12, 4)
    out = model(x)
    assert out.device.type == "cpu"  # output_device: CPU
    assert out.requires_grad == torch.is_grad_enabled()  # requires_grad: the grad mode
    with torch.no_grad():
        assert not model(x).requires_grad
    assert len(rows) >= len(model.devices) + 1  # num_microbatch: devices + 1
    assert rows[:len(model.devices) + 1] == [c.shape[0] for c in x.tensor_split(len(model.devices) + 1)]
    out.sum().backward()
    model.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_output_device_cuda():
    model = RoundPipe(nn.Sequential(nn.Linear(4, 3)))
    with torch.no_grad():
        out = model(torch.randn(6, 4), roundpipe_run_config=RoundPipeRunConfig(output_device=torch.device("cuda")))
    assert out.device.type == "cuda"

"""The original's custom-model quick start
(docs/UserGuide/QuickStart/resnet_cifar100.en.md): its ResNet written as an
nn.Sequential, wrapped as float16 with float32 masters and an optimizer
made under OptimizerCtx, its training loop (forward_backward with
return_outputs, loss_fn scaled and divided by torch.cuda.device_count() +
1, asynchronous steps, scaler.update), evaluate() after synchronize(), and
the plots. CIFAR-100 is replaced by random tensors of its format (3x32x32
float images, labels in 0..99; no torchvision: the transforms only prepare
data), the DataLoaders take num_workers=0, and training runs one epoch of
two batches of a narrow ResNet built from the page's BasicBlock and
make_blocks (the full one is only built and wrapped: it is too slow to
train on a CPU).

Asserted against plain PyTorch running the same float16 modules on the same
microbatches (the default num_microbatch, devices + 1; BatchNorm in training
mode normalizes each microbatch by its own statistics and updates the
running statistics microbatch after microbatch): each returned loss is the
sum of the microbatch losses as loss_fn computes them from the returned
outputs; both iterations run on the initial weights (asynchronous steps:
one update old); the running statistics; after synchronize() the float16
model holds the float32 masters; evaluate() is the plain model's in eval
mode.

Tolerances: the losses from the returned outputs: the same float32 cross
entropy of the same float16 values, 1e-5 relative. Outputs and statistics
against the float16 oracle: the same float16 operations, on another device
or in another summation order; the narrow ResNet's longest path rounds to
float16 (2^-11 relative) 14 times (5 convolutions, 5 normalizations, 2
additions, the pooling, the linear layer): 14 roundings of the largest
element, rounded up to 32 because a normalization rescales its input's
error by the ratio of the channel's largest element to its deviation
(FP16_TOL). (On the simulated device the operations are the CPU's own, in
the same order: equal.)"""
import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_close
from torch.utils.data import DataLoader, TensorDataset

FP16_TOL = 32 * 2.0**-11


# 2. Express ResNet as nn.Sequential (the page's code)
class BasicBlock(nn.Module):
    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


def make_blocks(in_channels, out_channels, blocks, stride):
    layers = []
    layers.append(BasicBlock(in_channels, out_channels, stride))
    for _ in range(1, blocks):
        layers.append(BasicBlock(out_channels, out_channels))
    return layers


def build_resnet(num_classes=100):
    layers = [
        nn.Conv2d(3, 32, 3, 1, 1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        *make_blocks(32, 64, 3, 2),
        *make_blocks(64, 128, 4, 2),
        *make_blocks(128, 256, 6, 2),
        *make_blocks(256, 512, 3, 2),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(512, num_classes),
    ]
    return nn.Sequential(*layers)


def build_narrow_resnet(num_classes=100):
    """The same layers, 8 to 16 channels, 2 blocks: trainable on a CPU in a test."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         *make_blocks(8, 16, 1, 2), *make_blocks(16, 16, 1, 2),
                         nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(16, num_classes))


def cifar100_like(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 100, (n,), generator=g))


def test_the_pages_resnet_is_wrapped_with_float32_masters():
    from roundpipe import RoundPipe, OptimizerCtx
    from roundpipe.optim import Adam

    model = RoundPipe(build_resnet().to(torch.float16), optim_dtype=torch.float32)

    with OptimizerCtx():
        optimizer = Adam(model.parameters())

    assert model.num_layers == 3 + (3 + 4 + 6 + 3) + 3  # each block a layer
    params = optimizer.param_groups[0]["params"]
    assert [id(p) for p in params] == [id(p) for p in model.optim_parameters()]
    assert all(p.dtype == torch.float32 for p in params)
    assert all(torch.equal(p.to(torch.float16), q) for p, q in zip(params, model.model.parameters()))


def test_training_evaluation_and_plots(monkeypatch):
    from roundpipe import RoundPipe, OptimizerCtx, GradScaler
    from roundpipe.optim import Adam
    from tqdm import tqdm

    torch.manual_seed(0)
    trainset, testset = cifar100_like(16, 1), cifar100_like(8, 2)
    trainloader = DataLoader(trainset, batch_size=8, shuffle=True, num_workers=0)
    testloader = DataLoader(testset, batch_size=8, shuffle=False, num_workers=0)

    net = build_narrow_resnet().to(torch.float16)
    plain = copy.deepcopy(net)  # the oracle, on the initial weights
    model = RoundPipe(net, optim_dtype=torch.float32)

    with OptimizerCtx():
        optimizer = Adam(model.parameters())

    scaler = GradScaler()
    criterion = nn.CrossEntropyLoss()

    # 5. Evaluation Function
    def evaluate(loader):
        model.eval()
        correct, total, loss_sum = 0, 0, 0
        with torch.no_grad():
            for images, labels in loader:
                images, labels = images.to(torch.float16), labels
                outputs = model(images)
                loss = criterion(outputs.float(), labels)
                loss_sum += loss.item() * labels.size(0)
                _, predicted = outputs.max(1)
                correct += predicted.eq(labels).sum().item()
                total += labels.size(0)
        return loss_sum / total, correct / total

    # 6. Training Loop (recording each iteration's inputs and results)
    seen = []
    forward_backward = model.forward_backward

    def recording_forward_backward(**kw):
        result = forward_backward(**kw)
        seen.append((kw["input_args"][0], kw["label"], result[0].clone(), result[1].clone()))
        return result

    monkeypatch.setitem(model.__dict__, "forward_backward", recording_forward_backward)  # this instance only

    train_losses, test_losses = [], []
    train_accs,   test_accs   = [], []

    def optimizer_step():
        scaler.step(optimizer)
        optimizer.zero_grad()

    EPOCHS = 1
    for epoch in range(EPOCHS):
        model.train()
        running_loss, correct, total = 0, 0, 0
        for images, labels in tqdm(trainloader, desc=f"Epoch {epoch+1}/{EPOCHS}", leave=False):
            loss, outputs = model.forward_backward(
                input_args=(images.to(torch.float16),),
                label=labels,
                loss_fn=lambda outputs, labels: scaler.scale(
                    criterion(outputs.float(), labels)
                ) / (torch.cuda.device_count() + 1),
                return_outputs=True,
            )
            model.step(optimizer_step)
            scaler.update()

            loss_item = loss.item() / scaler.get_scale()
            running_loss += loss_item * labels.size(0)
            _, predicted = outputs.max(1)
            correct += predicted.eq(labels).sum().item()
            total += labels.size(0)

        train_loss = running_loss / total
        train_acc = correct / total
        model.synchronize()  # the page's text: "Call model.synchronize() before evaluation" (its loop omits it)
        test_loss, test_acc = evaluate(testloader)

        train_losses.append(train_loss)
        test_losses.append(test_loss)
        train_accs.append(train_acc)
        test_accs.append(test_acc)

        print(
            f"Epoch {epoch+1:02d}/{EPOCHS} | "
            f"Train Loss: {train_loss:.4f} | Train Acc: {train_acc:.4f} | "
            f"Test Loss: {test_loss:.4f} | Test Acc: {test_acc:.4f}"
        )

    n = len(model.devices) + 1  # the default num_microbatch
    divisor = torch.cuda.device_count() + 1
    assert len(seen) == 2 and total == 16
    for images, labels, loss, outputs in seen:
        assert outputs.dtype == torch.float16 and outputs.shape == (8, 100)
        # the loss: loss_fn's values, summed over the microbatches
        expected = sum(2.0**16 * criterion(o.float(), t) / divisor
                       for o, t in zip(outputs.tensor_split(n), labels.tensor_split(n)))
        assert_close(loss, expected)
        # the outputs: the plain model on the initial weights, microbatch by microbatch
        plain.train()
        with torch.no_grad():
            reference = torch.cat([plain(x) for x in images.tensor_split(n)])
        torch.testing.assert_close(outputs.float(), reference.float(), rtol=0,
                                   atol=FP16_TOL * reference.abs().max().item())
    assert scaler.get_scale() == 2.0**16  # no overflow
    assert train_acc == sum(int(o.argmax(1).eq(t).sum()) for _, t, _, o in seen) / 16
    for (name, b), r in zip(net.named_buffers(), plain.buffers()):
        if b.dtype.is_floating_point:
            torch.testing.assert_close(b.float(), r.float(), rtol=0, atol=FP16_TOL * r.abs().max().item(),
                                       msg=name)
        else:
            assert torch.equal(b, r), name
    # synchronize(): the float16 model holds the (updated) float32 masters
    masters = list(model.optim_parameters())
    for p, m, q in zip(net.parameters(), masters, plain.parameters()):
        assert torch.equal(p, m.to(torch.float16))
    assert any(not torch.equal(m.to(torch.float16), q) for m, q in zip(masters, plain.parameters()))
    # evaluate(): the plain model with these weights, in eval mode
    for p, m in zip(plain.parameters(), masters):
        p.data.copy_(m.data)
    plain.eval()
    with torch.no_grad():
        images, labels = testset.tensors
        reference = plain(images.to(torch.float16)).float()
    tol = FP16_TOL * reference.abs().max().item()
    ref_loss = criterion(reference, labels).item()
    assert test_loss == pytest.approx(ref_loss, abs=2 * tol)  # cross entropy: at most 2x a logit's error
    top2 = reference.topk(2, dim=1).values
    unsure = int(((top2[:, 0] - top2[:, 1]) <= 2 * tol).sum())  # rows whose top class rounding may flip
    ref_acc = reference.argmax(1).eq(labels).float().mean().item()
    assert abs(test_acc - ref_acc) <= unsure / len(labels)
    assert not model.training

    # 7. Visualize the Training Curves
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    axes[0].plot(train_losses, label="Train Loss")
    axes[0].plot(test_losses, label="Test Loss")
    axes[0].set_xlabel("Epoch"); axes[0].set_ylabel("Loss")
    axes[0].legend(); axes[0].set_title("Loss Curve")
    axes[1].plot(train_accs, label="Train Acc")
    axes[1].plot(test_accs, label="Test Acc")
    axes[1].set_xlabel("Epoch")
    axes[1].set_ylabel("Accuracy")
    axes[1].legend()
    axes[1].set_title("Accuracy Curve")
    plt.tight_layout()
    plt.show()
    assert [line.get_ydata()[0] for line in axes[0].lines] == [train_loss, test_loss]
    plt.close(fig)

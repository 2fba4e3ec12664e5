"""Data parallelism across processes (issue 21): processes on loopback with
Gloo, each a RoundPipe on simulated devices fed its shard of the batch.
Training equals one process on the whole batch (the shards are of equal
size and the loss is a mean, so the mean over ranks of the shard gradients
is the whole batch's gradient), and all ranks end identical: replicated or
sharded optimizer state, automatic wrapping, roundpipe.train, torchrun; a
sharded checkpoint resumes with another process count; a rank that stops
makes the others fail with a clear error within the group's timeout
instead of hanging; replicas that start from different weights are
refused.

Tolerance: fp32, the same sums in another order (the all-reduce adds the
shards' gradients, the reference the whole batch's rows), through 3 Adam
steps: conftest's assert_adam_weights_close."""
import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import roundpipe
from roundpipe import RoundPipe

import conftest
from conftest import ADAM_EPS, GRAD_ERROR, assert_adam_weights_close

STEPS, ROWS, LR = 3, 12, 1e-2


class NotSequential(nn.Module):
    """A model automatic wrapping splits into parts and glue."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)


def mse_over(elements):
    """The mean squared error over `elements` values: each microbatch adds
    its share, so that the microbatches' losses add up to the shard's mean
    whatever their number."""
    return lambda out, label: ((out - label) ** 2).sum() / elements


def train(model, rank=0, world=1, is_async=False, sharded=False, steps=range(STEPS), load=None, save=None,
          report=None, forget_state=False, fused=False):
    """Trains `model` on this rank's shard of batches `steps`; `load` /
    `save`: a sharded checkpoint directory read before / written after;
    `report` (a dict) receives the optimizer state this process holds;
    `forget_state` drops the loaded optimizer state; `fused`: model.step(opt)
    instead of the step function."""
    pipe = RoundPipe(model, devices="sim:2", optim_dtype=torch.float32, shard_optimizer_state=sharded)
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=LR, eps=ADAM_EPS)
    if load:
        roundpipe.distributed.load_sharded(pipe, opt, load)
        if forget_state:
            opt.state.clear()
    shard = ROWS // world
    for step in steps:
        x, y = batch(step)
        rows = slice(rank * shard, (rank + 1) * shard)
        pipe.forward_backward(input_args=(x[rows],), label=y[rows], loss_fn=mse_over(y[rows].numel()))
        pipe.step(opt if fused else lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
    if save:
        roundpipe.distributed.save_sharded(pipe, opt, save)
    if report is not None:
        report["state"] = {n: sum(v.numel() for v in opt.state[p].values() if torch.is_tensor(v) and v.dim())
                           for n, p in pipe.optim_named_parameters()}
    pipe.synchronize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def first_step_gradients(rank=0, world=1, reduce_dtype=None, sharded=False):
    """The masters' gradients the first step's function sees (those this
    process owns, sharded), by name."""
    pipe = RoundPipe(make_model(), devices="sim:1", optim_dtype=torch.float32, reduce_dtype=reduce_dtype,
                     shard_optimizer_state=sharded)
    named = list(pipe.optim_named_parameters())
    x, y = batch(0)
    shard = ROWS // world
    rows = slice(rank * shard, (rank + 1) * shard)
    pipe.forward_backward(input_args=(x[rows],), label=y[rows], loss_fn=mse_over(y[rows].numel()))
    grads = {}
    pipe.step(lambda: grads.update({n: p.grad.clone() for n, p in named}), is_async=False)
    pipe.synchronize()
    return grads


def train_automatic(rank=0, world=1, is_async=False):
    """NotSequential through automatic wrapping: its blocks each a
    RoundPipe, its first layer glue on the CPU (skipped: as a small module
    it would be a RoundPipe of one microbatch); loss.backward() and step()
    on this rank's shard. Returns the weights and the parts' count."""
    model = NotSequential()
    pipe = roundpipe.wrap_model_to_roundpipe(model, devices="sim:1", optim_dtype=torch.float32,
                                             lower_threshold=600, upper_threshold=2000,
                                             skip_modules=["inner"])  # (left on the CPU: glue)
    opt = roundpipe.optim.Adam(pipe.optim_parameters(), lr=LR, eps=ADAM_EPS)
    shard = ROWS // world
    for step in range(STEPS):
        x, y = batch(step)
        rows = slice(rank * shard, (rank + 1) * shard)
        ((pipe(x[rows])[:, :4] - y[rows]) ** 2).mean().backward()
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
    pipe.synchronize()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, len(pipe.pipes), len(pipe._glue())


def tool_examples(n=48):
    """Prompt/completion examples of random lengths (the completion trained)."""
    from roundpipe.token_file import Example
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        out.append(Example(torch.randint(3, 90, (length,), generator=g).tolist(),
                           [0] * prompt + [1] * (length - prompt)))
    return out


def train_tool(output_dir, is_async, sharded=False):
    """roundpipe.train on a tiny Qwen3 (fp32): clipping that binds, 2
    accumulated calls a step, packed rows, Adam's eps at ADAM_EPS (weights
    comparable: conftest); returns its losses, norms, the trained weights
    and what it wrote. `sharded`: on a RoundPipe with sharded optimizer
    state (the clipping norm then adds up the processes' shares)."""
    from hf_models import tiny_qwen3
    model = tiny_qwen3()
    result = roundpipe.train(
        roundpipe.wrap_model_to_roundpipe(model, shard_optimizer_state=True) if sharded else model,
        tool_examples(), roundpipe.TrainingArguments(
        output_dir=output_dir, batch_size=4, grad_accum=2, max_steps=3, lr=3e-3, max_grad_norm=0.5,
        adam_epsilon=ADAM_EPS,
        num_microbatch=2, sync_step=not is_async, tensorboard=False, save_model=True))
    return (result.losses, result.grad_norms, {n: p.detach().clone() for n, p in model.named_parameters()},
            sorted(os.listdir(output_dir)))


def worker(rank, world, init, out, mode):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        if mode.startswith("automatic_wrapping_"):
            try:
                roundpipe.wrap_model_to_roundpipe(NotSequential(), devices="sim:1", shard_optimizer_state=True)
                refusal = "accepted"
            except NotImplementedError as e:
                refusal = str(e)
            result = train_automatic(rank, world, is_async=mode.endswith("async")) + (refusal,)
        elif mode == "different_weights":
            try:
                RoundPipe(make_model(seed=rank), devices="sim:1")
                result = "accepted"
            except ValueError as e:
                result = str(e)
        elif mode in ("one_stops", "one_stops_later"):
            if rank == 1 and mode == "one_stops":
                result = "stopped"  # leaves before making its RoundPipe
            elif rank == 1:
                pipe = RoundPipe(make_model(), devices="sim:1")  # and leaves before any step
                result = "stopped"
            else:
                try:
                    train(make_model(), rank, world)
                    result = "finished"
                except RuntimeError as e:
                    result = str(e)
        elif mode.startswith("first_grads_"):  # first_grads_{float32,bfloat16}[_sharded]
            dtype = getattr(torch, mode.split("_")[2])
            result = first_step_gradients(rank, world, dtype, sharded=mode.endswith("_sharded"))
        elif mode.startswith("train_"):  # roundpipe.train under the group: train_{sync,async}[_sharded]
            result = train_tool(os.path.join(out, f"run{rank}"), is_async=mode.startswith("train_async"),
                                sharded=mode.endswith("_sharded"))
        elif mode.startswith("sharded"):  # sharded_{sync,async,async_fused}[|save|DIR or |load|DIR]
            kind, action, directory = (mode.split("|") + ["", ""])[:3]
            report = {}
            kwargs = dict(is_async=kind.startswith("sharded_async"), sharded=True, report=report,
                          fused=kind.endswith("_fused"))
            if action == "save":
                kwargs.update(steps=range(2), save=directory)
            elif action == "load":
                kwargs.update(steps=range(2, STEPS + 1), load=directory)
            result = (train(make_model(), rank, world, **kwargs), report["state"])
        else:  # sync, async, async_fused
            result = train(make_model(), rank, world, is_async=mode.startswith("async"),
                           fused=mode.endswith("_fused"))
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        if not mode.startswith("one_stops"):
            dist.destroy_process_group()
        else:
            # A group with a departed member cannot be torn down cleanly (Gloo
            # may abort in its destructors): leave without the interpreter's
            # teardown, the result already written.
            os._exit(0)


def run_ranks(tmp_path, world, mode):
    init = tmp_path / "init"
    mp.spawn(worker, args=(world, str(init), str(tmp_path), mode), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world,mode", [(2, "sync"), (3, "sync"), (2, "async"), (2, "async_fused")])
def test_data_parallel_training_equals_one_process_on_the_whole_batch(tmp_path, world, mode):
    ranks = run_ranks(tmp_path, world, mode)  # async_fused: model.step(opt) in the ranks
    if mode.startswith("async"):
        # The async step trains on weights one update old in every process
        # alike: the reference is one process's async run on the whole batch.
        reference = train(make_model(), is_async=True)
    else:
        reference = train(make_model())
    for rank, weights in enumerate(ranks):
        for name, w in reference.items():
            assert torch.equal(weights[name], ranks[0][name]), f"rank {rank} diverged from rank 0 in {name}"
            assert_adam_weights_close(weights[name], w, steps=STEPS, lr=LR)
    # and training moved the weights (the comparison is not of two untouched models)
    start = dict(make_model().named_parameters())
    assert any(not torch.allclose(start[n], w, atol=1e-3) for n, w in reference.items())


@pytest.mark.parametrize("mode,error", [
    ("one_stops", "comparing the starting weights over the 2 processes of the group failed"),  # at construction
    ("one_stops_later", "data parallel: comparing the starting weights over 2 processes failed")])  # first step
def test_a_rank_that_stops_is_an_error_within_the_timeout_not_a_hang(tmp_path, mode, error):
    results = run_ranks(tmp_path, 2, mode)
    assert results[1] == "stopped"
    assert error in results[0], results[0]
    assert "timeout" in results[0]


def test_replicas_that_start_from_different_weights_are_refused(tmp_path):
    results = run_ranks(tmp_path, 2, "different_weights")
    for message in results:
        assert "start from different weights" in message and "manual_seed" in message, message


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_automatic_wrapping_averages_the_parts_and_the_glue(tmp_path, mode):
    """A model without a preset that is no nn.Sequential (AutoRoundPipe:
    parts each a RoundPipe, glue on the CPU) under a group: every master,
    the parts' and the glue's, is averaged once per step, so 2 processes
    train as one. Sharded optimizer state is refused there, naming the fix."""
    ranks = run_ranks(tmp_path, 2, f"automatic_wrapping_{mode}")
    reference, parts, glue = train_automatic(is_async=mode == "async")
    assert parts == 2 and glue == 2, "the case needs both parts and glue"
    for rank, (weights, _, _, refusal) in enumerate(ranks):
        assert "shard_optimizer_state is not supported by automatic wrapping" in refusal, refusal
        for name, w in reference.items():
            assert torch.equal(weights[name], ranks[0][0][name]), f"rank {rank} diverged from rank 0 in {name}"
            assert_adam_weights_close(weights[name], w, steps=STEPS, lr=LR)


@pytest.mark.parametrize("world,mode", [(2, "sync"), (3, "sync"), (3, "async"), (2, "async_fused")])
def test_sharded_optimizer_state_trains_as_one_process_and_holds_a_share(tmp_path, world, mode):
    """shard_optimizer_state: the same training as one process on the whole
    batch, every rank identical, and each master's Adam state on exactly one
    rank, about 1/N of it on each (contiguous runs of about equal bytes: at
    most one parameter over the even share). async_fused: the ranks step by
    model.step(opt) (Note [A fused step from Python]), the reference by the
    step function."""
    ranks = run_ranks(tmp_path, world, f"sharded_{mode}")
    reference = train(make_model(), is_async=mode.startswith("async"))
    for rank, (weights, _) in enumerate(ranks):
        for name, w in reference.items():
            assert torch.equal(weights[name], ranks[0][0][name]), f"rank {rank} diverged from rank 0 in {name}"
            assert_adam_weights_close(weights[name], w, steps=STEPS, lr=LR)
    whole = {n: 2 * p.numel() for n, p in make_model().named_parameters()}  # exp_avg, exp_avg_sq
    held = [state for _, state in ranks]
    names = [n for state in held for n in state]
    assert sorted(names) == sorted(whole), "every master's state on exactly one rank"
    assert all(state[n] == whole[n] for state in held for n in state)
    for state in held:
        assert 0 < sum(state.values()) <= sum(whole.values()) / world + max(whole.values())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sharded_checkpoint_resumes_with_another_number_of_processes(tmp_path, mode):
    """Two processes train 2 steps and save one file each; three processes,
    and one, resume from it for the remaining steps: the weights are one
    process's uninterrupted run on the whole batch (async: the pending
    update restored, so the resumed run is as stale as the saved one)."""
    saved = tmp_path / "checkpoint"
    for part in ("save", "resume"):
        (tmp_path / part).mkdir()
    run_ranks(tmp_path / "save", 2, f"sharded_{mode}|save|{saved}")
    assert sorted(os.listdir(saved)) == [f"optimizer-rank0000{r}-of-00002.pt" for r in range(2)]
    reference = train(make_model(), is_async=mode == "async", steps=range(STEPS + 1))
    resumed = [w for w, _ in run_ranks(tmp_path / "resume", 3, f"sharded_{mode}|load|{saved}")]
    resumed.append(train(make_model(), is_async=mode == "async", sharded=True, steps=range(2, STEPS + 1),
                         load=saved))
    for weights in resumed:
        for name, w in reference.items():
            assert_adam_weights_close(weights[name], w, steps=STEPS + 1, lr=LR)
    # The checkpoint's optimizer moments matter: without them the same
    # resumption lands elsewhere.
    forgot = train(make_model(), is_async=mode == "async", sharded=True, steps=range(2, STEPS + 1), load=saved,
                   forget_state=True)
    with pytest.raises(AssertionError):
        for name, w in reference.items():
            assert_adam_weights_close(forgot[name], w, steps=STEPS + 1, lr=LR)


@pytest.mark.parametrize("mode", ["sync", "async", "async_sharded"])
def test_roundpipe_train_under_a_group_trains_as_one_process_and_rank_0_writes(tmp_path, mode):
    """roundpipe.train in 2 processes (as under torchrun): each trains on
    half of every batch, and the losses (the step's token mean over both
    shares), gradient norms (clipping binds) and weights are one process's
    on the whole batches; only rank 0 writes the metrics and the model."""
    ranks = run_ranks(tmp_path, 2, f"train_{mode}")
    losses, norms, weights, written = train_tool(str(tmp_path / "alone"), is_async=mode.startswith("async"))
    assert all(n > 0.5 for n in norms), "clipping never bound: the test shows less"
    for rank, (r_losses, r_norms, r_weights, r_written) in enumerate(ranks):
        assert r_losses == pytest.approx(losses, rel=1e-4), f"rank {rank}"
        assert r_norms == pytest.approx(norms, rel=1e-4), f"rank {rank}"
        for name, w in weights.items():
            assert_adam_weights_close(r_weights[name], w, steps=3, lr=3e-3)
    assert ranks[0][3] == written and "metrics.jsonl" in written and "model.safetensors" in written
    assert ranks[1][3] == [], "rank 1 wrote files"
    lines = [json.loads(l) for l in open(tmp_path / "run0" / "metrics.jsonl")]
    assert [l["loss"] for l in lines if "loss" in l] == pytest.approx(losses, rel=1e-4)


def test_a_one_process_script_runs_unchanged_under_torchrun(tmp_path):
    """torchrun's environment alone (no init_process_group in the script):
    the RoundPipe made inside roundpipe.train joins the default group that
    the package sets up on Gloo, and the two processes train as one."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "from test_distributed import train_tool\n"
        "rank = int(os.environ['RANK'])\n"
        f"result = train_tool(os.path.join({str(tmp_path)!r}, f'run{{rank}}'), is_async=False)\n"
        f"torch.save(result, os.path.join({str(tmp_path)!r}, f'rank{{rank}}.pt'))\n")
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses, norms, weights, _ = train_tool(str(tmp_path / "alone"), is_async=False)
    for rank in range(2):
        r_losses, r_norms, r_weights, r_written = torch.load(tmp_path / f"rank{rank}.pt")
        assert r_losses == pytest.approx(losses, rel=1e-4)
        for name, w in weights.items():
            assert_adam_weights_close(r_weights[name], w, steps=3, lr=3e-3)
    assert torch.load(tmp_path / "rank1.pt")[3] == []


@pytest.mark.parametrize("sharded", [False, True])
def test_gradients_can_cross_the_network_in_bfloat16(tmp_path, sharded):
    """reduce_dtype=torch.bfloat16 (half of float32's bytes): the averaged
    gradient is the whole batch's within bf16's rounding, each rank's share
    rounded to 8 bits of mantissa (2^-9 of it) and their sum once more, so
    within 2^-7 of the largest gradient; in float32, within the reordered
    sums' GRAD_ERROR. The bf16 result differs from the float32 one (it is
    used)."""
    whole = first_step_gradients()
    for dtype, bound in (("float32", GRAD_ERROR), ("bfloat16", 2.0 ** -7)):
        suffix = "_sharded" if sharded else ""
        (tmp_path / dtype).mkdir()
        ranks = run_ranks(tmp_path / dtype, 2, f"first_grads_{dtype}{suffix}")
        seen = {}
        for grads in ranks:
            seen.update(grads)
        assert sorted(seen) == sorted(whole), "every master's averaged gradient on some rank"
        scale = max(float(g.abs().max()) for g in whole.values())
        worst = max(float((seen[n] - g).abs().max()) for n, g in whole.items())
        assert worst <= bound * scale, (dtype, worst, scale)
        if dtype == "bfloat16":
            assert worst > GRAD_ERROR * scale, "the bf16 reduction rounded nothing: was it used?"


# ---------------------------------------------------------------- C++ roundpipe-train
# The C++ tool under torchrun (--no-python): its processes train data
# parallel over c10d's Gloo process group (issue 21 in C++), each on its
# share of every batch, rank 0 alone writing.

def run_cpp_train(out, processes, *extra, steps=4, port=None):
    """roundpipe-train on the built-in addition task, alone or under torchrun."""
    import subprocess
    import sys
    args = ["--config", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3-tiny", "config.json"),
            "--task", "addition", "--train-examples", "96", "--eval-examples", "12", "--batch-size", "12",
            "--steps", str(steps), "--devices", "sim:1", "--log-every", "1", "--seed", "5", "--lr", "1e-3",
            "--output", str(out), *extra]
    binary = conftest.roundpipe_train_binary()
    if processes == 1:
        command = [binary, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(processes), "--no-python", binary, *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def metrics_of(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "loss" in json.loads(line)]


def model_weights(out):
    from safetensors.torch import load_file
    weights = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(out, name)))
    return weights


def assert_same_training(ours, alone, steps):
    """Losses and gradient norms step for step (the same sums in another
    order: fp32 rounding); the norm is of the averaged gradient before
    clipping, so a wrong share or a wrong mean shows there. Weights after
    `steps` Adam steps at the tool's eps (1e-8) and lr (1e-3): a step moves
    a weight by at most ~lr, so runs on gradients that differ by rounding
    differ by at most 2 lr a step (where a gradient is within rounding of
    zero)."""
    mine, theirs = metrics_of(ours), metrics_of(alone)
    assert [m["step"] for m in mine] == [m["step"] for m in theirs]
    for a, b in zip(mine, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tokens"] == b["tokens"] and a["loss_tokens"] == b["loss_tokens"]
    w_ours, w_alone = model_weights(ours), model_weights(alone)
    assert w_ours.keys() == w_alone.keys()
    for name, w in w_alone.items():
        diff = (w_ours[name].float() - w.float()).abs().max().item()
        assert diff <= 2 * steps * 1e-3, (name, diff)


@pytest.mark.parametrize("processes,packing", [(2, []), (3, []), (2, ["--no-packing"]),
                                               (3, ["--shard-optimizer-state"]),
                                               (2, ["--no-packing", "--shard-optimizer-state"])])
def test_cpp_roundpipe_train_under_torchrun_trains_as_one_process(tmp_path, processes, packing):
    out = run_cpp_train(tmp_path / "dp", processes, *packing)
    run_cpp_train(tmp_path / "alone", 1, *packing)
    assert f"data parallel: {processes} processes, {12 // processes} examples of each batch" in out
    assert ("optimizer state sharded" in out) == ("--shard-optimizer-state" in packing)
    assert out.count("summary:") == 1  # rank 0 alone prints
    assert_same_training(tmp_path / "dp", tmp_path / "alone", steps=4)


def test_cpp_roundpipe_train_checkpoint_of_2_processes_resumes_with_3(tmp_path):
    """Rank 0 writes the training checkpoint every process holds; another
    process count resumes it (the state is the same on every process)."""
    run_cpp_train(tmp_path / "dp", 2, "--checkpoint-every", "2", steps=3)
    run_cpp_train(tmp_path / "dp", 3, "--resume", "--allow-resume-change", "steps", steps=4)
    run_cpp_train(tmp_path / "alone", 1, steps=4)
    assert_same_training(tmp_path / "dp", tmp_path / "alone", steps=4)


def test_cpp_roundpipe_train_sharded_checkpoint_resumes_with_another_process_count(tmp_path):
    """With --shard-optimizer-state every process writes its share of the
    masters and moments; 3 sharded processes resume the checkpoint 2 wrote
    and train as one uninterrupted process (tests/api/data_parallel_test.cpp
    resumes shares in one unsharded process too)."""
    run_cpp_train(tmp_path / "dp", 2, "--shard-optimizer-state", "--checkpoint-every", "2", steps=3)
    checkpoint = str(tmp_path / "dp") + ".ckpt"
    shares = sorted(n for n in os.listdir(checkpoint) if n.startswith("master-rank"))
    assert shares == ["master-rank00000-of-00002.safetensors", "master-rank00001-of-00002.safetensors"]
    run_cpp_train(tmp_path / "dp", 3, "--shard-optimizer-state", "--resume", "--checkpoint-every", "1",
                  "--allow-resume-change", "steps", steps=4)
    assert sorted(n for n in os.listdir(checkpoint) if n.startswith("optimizer-rank"))[-1] == \
        "optimizer-rank00002-of-00003.safetensors"
    run_cpp_train(tmp_path / "alone", 1, steps=4)
    assert_same_training(tmp_path / "dp", tmp_path / "alone", steps=4)


def test_cpp_roundpipe_train_rank_that_dies_fails_the_others_with_a_clear_error(tmp_path):
    """Two processes started by hand with torchrun's variables (no agent to
    stop the survivor): rank 1 is killed after the first step; rank 0 fails
    within its --dist-timeout, naming what it was doing, instead of hanging."""
    import signal
    import socket
    import subprocess
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--config", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3-tiny", "config.json"),
            "--task", "addition", "--train-examples", "2000", "--batch-size", "4", "--steps", "400",
            "--devices", "sim:1", "--log-every", "1", "--dist-timeout", "20"]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([conftest.roundpipe_train_binary(), *args, "--output", str(tmp_path / f"r{rank}")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    line = procs[0].stdout.readline()
    while line and "step 1/" not in line:
        line = procs[0].stdout.readline()
    assert "step 1/" in line, procs[0].stderr.read()[-3000:]
    procs[1].send_signal(signal.SIGKILL)
    start = time.monotonic()
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode == 1, err[-3000:]
    assert time.monotonic() - start < 60
    assert "Another process most likely stopped" in err, err[-3000:]
    procs[1].wait()


def test_cpp_roundpipe_train_signal_to_one_process_stops_all_after_the_step(tmp_path):
    """SIGINT to rank 1 alone (processes started by hand with torchrun's
    variables): every process stops after the same step, rank 0 writes the
    training checkpoint of that step."""
    import signal
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "qwen3-tiny", "config.json")
    args = ["--config", config, "--task", "addition", "--train-examples", "2000", "--batch-size", "4",
            "--steps", "400", "--devices", "sim:1", "--log-every", "1", "--output", str(tmp_path / "out")]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([conftest.roundpipe_train_binary(), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    line = procs[0].stdout.readline()
    while line and "step 2/" not in line:
        line = procs[0].stdout.readline()
    assert "step 2/" in line, procs[0].stderr.read()[-3000:]
    procs[1].send_signal(signal.SIGINT)
    out0, err0 = procs[0].communicate(timeout=120)
    _, err1 = procs[1].communicate(timeout=120)
    assert procs[1].returncode == 128 + signal.SIGINT, err1[-3000:]
    assert procs[0].returncode == 128 + signal.SIGTERM, err0[-3000:]
    assert "another process's signal" in err0
    stopped = [int(e.split("after step ")[1].split(" ")[0]) for e in (err0, err1)]
    assert stopped[0] == stopped[1], (err0, err1)
    with open(tmp_path / "out.ckpt" / "checkpoint.json") as f:
        assert json.load(f)["extra"]["step"] == str(stopped[0])

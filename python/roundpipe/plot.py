"""Draws the curves of one or several training runs (their metrics.jsonl,
written by roundpipe-train and roundpipe.train) to a PNG with matplotlib:

    python -m roundpipe.plot roundpipe-out other-run/metrics.jsonl -o curves.png

Panels: training loss (and held-out loss, dashed, where evaluated),
throughput (tokens/s), learning rate, and gradient norm.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List


def read_metrics(run: str) -> Dict[str, List]:
    """A run's metrics (a folder holding metrics.jsonl, or the file) as
    columns: step lines (loss, lr, tokens_per_second, grad_norm) and
    evaluation points (eval_step, eval_loss)."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run}: no metrics.jsonl (train with roundpipe-train or "
                                "roundpipe.train first)")
    columns: Dict[str, List] = {k: [] for k in ("step", "loss", "lr", "tokens_per_second",
                                                 "grad_norm", "eval_step", "eval_loss")}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from error
            if "eval_loss" in entry:
                columns["eval_step"].append(entry["step"])
                columns["eval_loss"].append(entry["eval_loss"])
            if "loss" in entry:
                columns["step"].append(entry["step"])
                for key in ("loss", "lr", "tokens_per_second", "grad_norm"):
                    value = entry.get(key)
                    columns[key].append(float("nan") if value is None else value)
    return columns


def plot_runs(runs: List[str], output: str, labels: List[str] = None) -> str:
    """Draws ``runs`` into ``output`` (PNG); returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [os.path.basename(os.path.normpath(r)) or r for r in runs]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    (loss_ax, speed_ax), (lr_ax, norm_ax) = axes
    for run, label in zip(runs, labels):
        m = read_metrics(run)
        line, = loss_ax.plot(m["step"], m["loss"], label=f"{label} train")
        if m["eval_step"]:
            loss_ax.plot(m["eval_step"], m["eval_loss"], "o--", color=line.get_color(),
                         label=f"{label} held out")
        # The first step includes warm-up (plans, allocations): left out.
        speed_ax.plot(m["step"][1:], m["tokens_per_second"][1:], color=line.get_color(), label=label)
        lr_ax.plot(m["step"], m["lr"], color=line.get_color(), label=label)
        norm_ax.plot(m["step"], m["grad_norm"], color=line.get_color(), label=label)
    # Losses and norms fall by orders of magnitude: a log scale where all are positive.
    for ax in (loss_ax, norm_ax):
        values = [y for line in ax.get_lines() for y in line.get_ydata() if y == y]
        if values and min(values) > 0:
            ax.set_yscale("log")
    for ax, title in ((loss_ax, "loss"), (speed_ax, "tokens / s"), (lr_ax, "learning rate"),
                      (norm_ax, "gradient norm (before clipping)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roundpipe.plot",
                                     description="Plot the loss, held-out loss, throughput, "
                                                 "learning rate and gradient norm of runs.")
    parser.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl) or the files")
    parser.add_argument("-o", "--output", default="curves.png", help="the PNG to write")
    parser.add_argument("--labels", nargs="*", help="a name per run (default: folder names)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels gives {len(args.labels)} names for {len(args.runs)} runs")
    try:
        plot_runs(args.runs, args.output, args.labels)
    except (FileNotFoundError, ValueError) as error:
        print(f"roundpipe.plot: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

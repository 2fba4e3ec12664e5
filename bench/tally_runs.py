#!/usr/bin/env python3
"""Tallies gpu_user.sh's result lines by workload: how many runs, how many
printed an out-of-memory warning or failed, the peak reserved memory against
the issue's bound (the cap less 1.5 GiB, what a real card of that size leaves
the allocator), and how far the allocated peak came above the plan's
prediction. Usage: tally_runs.py user_runs.txt [more files]."""
import re
import sys
from collections import OrderedDict


def fields(line):
    # A failed run's line carries the error's text between "FAILED:" and the
    # harness's counts: only what is outside it is read.
    head, failed, tail = line.partition("FAILED:")
    if failed:
        head += " " + tail[tail.rfind(" oom_warnings="):]
    return dict(re.findall(r"(\w+)=(\S+)", head))


def main(paths):
    groups = OrderedDict()
    for path in paths:
        for line in open(path):
            line = re.sub(r"^repeat \d+: ", "", line.strip())
            if not line.startswith(("impl=", "[base] impl=")):
                continue
            f = fields(line)
            tree = "base" if line.startswith("[base]") else f["impl"]
            key = (tree, f["shape"], f.get("lora", "0"), f["cap"])
            g = groups.setdefault(key, {"runs": 0, "warned": 0, "failed": 0, "reserved": [], "over": []})
            g["runs"] += 1
            g["warned"] += int(f.get("oom_warnings", "0")) > 0
            g["failed"] += "FAILED" in line or f.get("exit", "0") != "0"
            if "peak_reserved" in f:
                g["reserved"].append(float(f["peak_reserved"]))
            if "peak_alloc" in f and float(f.get("predicted", "0")) > 0:
                g["over"].append(float(f["peak_alloc"]) - float(f["predicted"]))
    print("| tree | workload | runs | with out-of-memory warnings | failed | peak reserved (min-max) | bound | within | allocated above predicted (max) |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: | --- | ---: |")
    for (tree, shape, lora, cap), g in groups.items():
        capped = float(cap) > 0  # (cap 0: no cap, so no bound)
        bound = float(cap) - 1.5
        res = g["reserved"]
        span = f"{min(res):.2f}-{max(res):.2f} GiB" if res else "-"
        within = "yes" if res and max(res) <= bound + 1e-9 else ("-" if not res else "**no**")
        over = f"{max(g['over']):+.2f} GiB" if g["over"] else "-"
        name = f"{shape}{' LoRA' if lora != '0' else ''}, {cap + ' GiB' if capped else 'no cap'}"
        print(f"| {tree} | {name} | {g['runs']} | {g['warned']} | {g['failed']} | {span} "
              f"| {f'{bound:.1f}' if capped else '-'} | {within if capped else '-'} | {over} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bench-out/user_runs.txt"])

"""bench/tally_runs.py, which the closing notes' out-of-memory counts come
from: each run counted once under its own workload and tree, a failed run's
error text never read as the run's fields, a peak over the bound flagged."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tally():
    spec = importlib.util.spec_from_file_location("tally_runs", os.path.join(ROOT, "bench", "tally_runs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_line(cap, reserved, alloc, predicted, warnings=0, base=False, shape="1.7B"):
    line = (f"impl=ours shape={shape} lora=0 cap={cap} tokens=16x4096 tok_s=37000 plan=1+2 "
            f"peak_alloc={alloc} peak_reserved={reserved} predicted={predicted} "
            f"oom_warnings={warnings} unknown_size_warnings=0 exit=0 (76s)")
    return ("[base] " if base else "") + line


def test_runs_are_tallied_by_tree_and_workload(tmp_path, capsys):
    log = tmp_path / "user_runs.txt"
    log.write_text("\n".join([
        run_line(24, 22.40, 19.96, 19.94),
        "repeat 2: " + run_line(24, 22.48, 20.01, 19.94, warnings=2),  # CONCURRENT's prefix
        run_line(24, 21.00, 18.00, 19.00, base=True),
        run_line(12, 10.51, 9.00, 9.10, shape="4B"),
        # A failed run: its error names another cap, which must not move it.
        "impl=ours shape=4B cap=12 env=none FAILED: StageError cap=99 shape=8B CUDA out of memory"
        " oom_warnings=1 unknown_size_warnings=0 exit=1 (40s)",
        "some other line of the log",
        run_line(0, 41.40, 40.10, 19.00),  # no cap: no bound to be within
    ]) + "\n")
    load_tally().main([str(log)])
    rows = {tuple(c.strip() for c in row.split("|")[1:3]): [c.strip() for c in row.split("|")[3:-1]]
            for row in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {("ours", "1.7B, 24 GiB"), ("base", "1.7B, 24 GiB"), ("ours", "4B, 12 GiB"),
                         ("ours", "1.7B, no cap")}
    # runs, with warnings, failed, reserved span, bound, within, allocated above predicted
    assert rows[("ours", "1.7B, 24 GiB")] == ["2", "1", "0", "22.40-22.48 GiB", "22.5", "yes", "+0.07 GiB"]
    assert rows[("base", "1.7B, 24 GiB")] == ["1", "0", "0", "21.00-21.00 GiB", "22.5", "yes", "-1.00 GiB"]
    assert rows[("ours", "4B, 12 GiB")] == ["2", "1", "1", "10.51-10.51 GiB", "10.5", "**no**", "-0.10 GiB"]
    assert rows[("ours", "1.7B, no cap")] == ["1", "0", "0", "41.40-41.40 GiB", "-", "-", "+21.10 GiB"]

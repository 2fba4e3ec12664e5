"""Runs a command and prints its peak resident host memory (the kernel's
maxrss of the child) with torchrun's RANK, for per-process host memory of
data-parallel runs: torchrun --no-python python3 bench/peak_rss.py CMD..."""
import os
import resource
import subprocess
import sys

code = subprocess.call(sys.argv[1:])
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(f"peak host resident of rank {os.environ.get('RANK', '0')}: {peak / 2**30:.1f} GiB", file=sys.stderr)
sys.exit(code)

#!/usr/bin/env bash
# On the GPU machine, in one call: pip-install the Python package from source
# against the machine's torch (as gpu_python.sh does), then check padded and
# packed 32K-token batches on CUDA against transformers (bench/gpu_masks.py:
# loss, logits, gradients within bf16 tolerance; peak device memory of each).
# TOKENS=N changes the size. Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
$py -m pip install -q --no-index --find-links .deps/wheels "scikit-build-core>=0.10" 2>&1 | tail -2
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  $py -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } 2>&1 | tee "$out/machine.txt"
JOBS=16 PYTHON=$py scripts/install_python.sh 2>&1 | tee "$out/pip_install.log" | tail -2
$py bench/gpu_masks.py "${TOKENS:-32768}" 2>&1 | tee "$out/gpu_masks.log"
exit "${PIPESTATUS[0]}"

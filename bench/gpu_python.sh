#!/usr/bin/env bash
# On the GPU machine, in one call: pip-install the Python package from source
# against the machine's torch (wheels for the build backend and pytest come
# from .deps/wheels: scripts/vendor_deps.sh), run the pytest suite with the
# CUDA backend, then train a random-weight Qwen3-1.7B-shaped model with the
# seed's Python code and with the C++ roundpipe-train (same shape, dtype,
# batch and microbatches). Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
steps="${STEPS:-10}"
# The machine's python3 (a venv with torch and transformers): install there.
py=python3
$py -m pip install -q --no-index --find-links .deps/wheels "scikit-build-core>=0.10" pytest 2>&1 | tail -2
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; $py --version
  $py -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } 2>&1 | tee "$out/machine.txt"
start=$(date +%s)
JOBS=16 PYTHON=$py scripts/install_python.sh 2>&1 | tee "$out/pip_install.log" | tail -2
echo "pip install took $(( $(date +%s) - start ))s" | tee -a "$out/pip_install.log"
# The C++ tool for the side-by-side figure, built meanwhile.
(JOBS=8 PYTHON=$py scripts/build.sh build-gpu -DROUNDPIPE_BUILD_TESTS=OFF > "$out/cpp_build.log" 2>&1) &
build_pid=$!
timeout 400 $py -X faulthandler -m pytest -q -p no:cacheprovider tests/python 2>&1 | tee "$out/pytest.log" | tail -4
if [ -n "${PYTEST_ONLY:-}" ]; then kill $build_pid 2>/dev/null; exit 0; fi
$py bench/make_qwen3_checkpoint.py /tmp/qwen3-1.7b /tmp/tokens.jsonl 1.7B 64 4096 2>&1 | tail -1 | tee "$out/checkpoint.log"
$py bench/python_seed_train.py /tmp/qwen3-1.7b "$steps" 16 4096 2>&1 | tee "$out/python_seed_1.7b.log"
wait $build_pid; tail -1 "$out/cpp_build.log"
./build-gpu/roundpipe-train --model /tmp/qwen3-1.7b --data /tmp/tokens.jsonl --seq-len 4096 \
  --batch-size 16 --microbatches 4 --steps "$steps" --dtype float16 --devices cuda --log-every 1 \
  --lr 1e-5 2>&1 | tee "$out/cpp_train_1.7b.log"

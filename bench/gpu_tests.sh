#!/usr/bin/env bash
# On the GPU machine: build from source against its torch and run the whole
# test suite with the CUDA backend beside the simulated ones; then the demo on
# the GPU. Logs go to $OUT (or ./bench-out). Run from the repository root,
# carrying .deps (scripts/vendor_deps.sh) when the machine lacks GoogleTest.
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
export PYTHON="${PYTHON:-python3}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc;
  "$PYTHON" -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'; } 2>&1 | tee "$out/machine.txt"
JOBS=16 scripts/build.sh build-gpu 2>&1 | tail -3 | tee "$out/build.log"
cd build-gpu
ctest --output-on-failure -j 4 --timeout 600 2>&1 | tee "$out/ctest.log" | tail -15
ROUNDPIPE_TEST_BACKENDS="cuda" ./tests/roundpipe_tests --gtest_filter='*cuda*' 2>&1 | tee "$out/cuda_only.log" | tail -4
ROUNDPIPE_DEVICES=cuda ./roundpipe-demo 40 2>&1 | tee "$out/demo.log" | tail -6
# The CPU optimizer benchmark on this machine's host CPU.
./roundpipe-optim-bench --benchmark_color=false 2>&1 | tee "$out/optim_bench.log" | tail -9

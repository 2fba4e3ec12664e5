#!/usr/bin/env bash
# On the GPU machine: build the test binary from source and run the pin-mode,
# staging-ring, optimizer-loop and mapped-checkpoint tests on the CUDA
# backend (carry .deps). Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
export PYTHON="${PYTHON:-python3}"
SECONDS=0
JOBS=16 scripts/build.sh build-gpu -DROUNDPIPE_BUILD_PYTHON=OFF -DROUNDPIPE_BUILD_TOOLS=OFF 2>&1 | tail -2 | tee "$out/build.log"
echo "built after ${SECONDS}s" | tee -a "$out/build.log"
ROUNDPIPE_TEST_BACKENDS="cuda;sim:2,jitter_us=150" timeout 300 ./build-gpu/tests/roundpipe_tests \
  --gtest_filter='*PinMode*:*OptimizerLoop*:*StagingRing*:CausalLMCheckpoint.*:*HostArena*' 2>&1 \
  | tee "$out/pin_tests.log" | grep -E "^\[  (PASSED|FAILED)|tests ran|FAILED" | tail -8

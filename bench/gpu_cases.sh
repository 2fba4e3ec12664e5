#!/usr/bin/env bash
# The GPU checks of a build with tests (used by gpu_bench.sh and
# gpu_compare.sh): the README example alone in a fresh process on cuda:0,
# where nothing has touched CUDA before the engine is made (the test
# binary's earlier cases would hide that), then the GPU test cases.
# Usage: bench/gpu_cases.sh BUILD_DIR LOG
set -uo pipefail
build="$1" log="$2"
ROUNDPIPE_DEVICES=cuda:0 "$build/tests/readme_example" > "$log" 2>&1 &&
  echo "readme example on cuda:0 (fresh process): ok" || echo "readme example on cuda:0: FAILED"
"$build/tests/roundpipe_tests" \
  --gtest_filter="${GPU_TESTS:-*FusedOps*:*ThroughRoundPipeMatchesTransformers*:*HostArena*:*cuda*}" \
  >> "$log" 2>&1
grep -E '^\[  (PASSED|FAILED)' "$log" | tail -8

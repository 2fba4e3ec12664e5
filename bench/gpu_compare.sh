#!/usr/bin/env bash
# On the GPU machine, in one call: the same benchmark on two versions of the
# code, to show that a change leaves speed and memory alone. BASE_TREE is a
# source tree of the earlier version (make it here with
#   git archive <commit> | tar -x -C .gpu-base   # and carry .gpu-base),
# the working tree is the later one. Builds both (the base: roundpipe-bench
# only; with TESTS=1 the current tree's tests too, and runs the GPU cases),
# then runs roundpipe-bench on each, alternating, ROUNDS times, and prints
# their tables. Logs go to $OUT (or ./bench-out, ignored by git).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
base="${BASE_TREE:-.gpu-base}"
export PYTHON="${PYTHON:-python3}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date -u; } > "$out/build.log" 2>&1
SECONDS=0
tests=OFF; [ -n "${TESTS:-}" ] && tests=ON
# Both builds at once, half the cores each.
(cd "$base" && ln -sfn ../.deps .deps && BUILD_TARGETS=roundpipe-bench JOBS=8 scripts/build.sh build-gpu \
  -DROUNDPIPE_BUILD_TESTS=OFF > "$out/build_base.log" 2>&1; echo "base build: $? after ${SECONDS}s") &
JOBS=8 scripts/build.sh build-gpu -DROUNDPIPE_BUILD_TESTS=$tests > "$out/build_head.log" 2>&1
echo "head build: $? after ${SECONDS}s"
wait
if [ "$tests" = ON ]; then
  bench/gpu_cases.sh build-gpu "$out/gpu_tests.log"
  echo "tests done after ${SECONDS}s"
fi
args=(--shape "${SHAPE:-1.7B}" --batch 16 --seq 4096 --microbatches 4 --warmup "${WARMUP:-3}"
  --steps "${STEPS:-6}" --devices "${DEVICES:-cuda:0}" --profile 0 ${BENCH_ARGS:-})
for round in $(seq 1 "${ROUNDS:-2}"); do
  for version in base head; do
    bin=./build-gpu/roundpipe-bench; [ "$version" = base ] && bin="$base/build-gpu/roundpipe-bench"
    echo "=== $version, round $round ===" >> "$out/bench_$version.log"
    "$bin" "${args[@]}" >> "$out/bench_$version.log" 2>&1
    echo "--- $version, round $round"
    sed -n "/=== $version, round $round ===/,\$p" "$out/bench_$version.log" |
      grep -E "tokens/s|peak device|host arena"
  done
done
echo "total: ${SECONDS}s"

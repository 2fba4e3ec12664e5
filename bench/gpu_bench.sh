#!/usr/bin/env bash
# On the GPU machine, in one call: build (with TESTS=1 also the test suite,
# then run the GPU-only checks: the fused kernels against the plain LibTorch
# compositions, the presets through RoundPipe against transformers), then for
# each Qwen3 shape and each device set print roundpipe-bench's table (with a
# kernel profile) next to the GPU-resident HuggingFace run of the same shape
# and settings, and search the longest sequence under a 24 GiB cap.
# Logs go to $OUT (or ./bench-out, ignored by git). SHAPES, STEPS, DEVICES
# (space-separated device specs, e.g. "cuda:0 cuda" on two GPUs; DEVICES_4B
# for the 4B shape), TRACE (ROUNDPIPE_TRACE),
# PROFILE (profiled steps), SKIP_HF, SKIP_TRANSFER, SKIP_MAX_SEQ override the
# defaults; COMPARE_PIPELINE=1 also runs multi-GPU on the pipelined plan. At most 8
# log files: what the device tool brings back.
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
export PYTHON="${PYTHON:-python3}"
# (The machine and the build share one log: the device tool returns 8 files.)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; date -u; git log -1 --oneline; } \
  > "$out/build.log" 2>&1
SECONDS=0
tests=OFF; [ -n "${TESTS:-}" ] && tests=ON
BUILD_TARGETS="${BUILD_TARGETS:-}" JOBS=16 scripts/build.sh build-gpu -DROUNDPIPE_BUILD_TESTS=$tests 2>&1 | tail -1 | tee -a "$out/build.log"
echo "build: ${SECONDS}s" | tee -a "$out/build.log"
if [ "$tests" = ON ]; then
  bench/gpu_cases.sh build-gpu "$out/gpu_tests.log"
fi
steps="${STEPS:-10}"
# bench LOG ARGS...: roundpipe-bench with ARGS appended to LOG, then its
# table (without the per-layer timings and trace lines) on stdout.
bench() {
  local log="$out/$1"; shift
  ROUNDPIPE_TRACE="${TRACE:-}" ./build-gpu/roundpipe-bench --steps "$steps" --verbose "$@" >> "$log" 2>&1
  grep -v '^  layer\|^\[trace' "$log" | grep -A18 '^roundpipe-bench' | tail -20
}
for shape in ${SHAPES:-1.7B 4B}; do
  devices_for_shape="${DEVICES:-cuda}"
  [ "$shape" = 4B ] && devices_for_shape="${DEVICES_4B:-$devices_for_shape}"
  for devices in $devices_for_shape; do
    log="bench_${shape}_${devices/:/}.log"
    : > "$out/$log"
    bench "$log" --shape "$shape" --batch 16 --seq 4096 --microbatches 4 --warmup "${WARMUP:-5}" \
      --devices "$devices" --profile "${PROFILE:-2}"
    if [ -n "${COMPARE_PIPELINE:-}" ] && [ "$devices" = cuda ]; then
      # The same on the pipelined plan (replicated tails off), appended.
      echo "=== ROUNDPIPE_TAIL_REPLICAS=0 (pipelined plan) ===" >> "$out/$log"
      ROUNDPIPE_TAIL_REPLICAS=0 bench "$log" --shape "$shape" --batch 16 --seq 4096 --microbatches 4 \
        --warmup "${WARMUP:-5}" --devices "$devices" --profile 0
    fi
  done
  if [ -z "${SKIP_HF:-}" ]; then
    "$PYTHON" bench/hf_resident_train.py "$shape" 16 4096 4 "$steps" bfloat16 2>&1 | tail -1 |
      tee -a "$out/hf.log"
  fi
done
if [ -z "${SKIP_TRANSFER:-}" ]; then
  # Transfer-bound: frozen linear weights (no optimizer work on them), one
  # 4096-token sequence, an 8 GiB plan limit (several stages, each uploaded
  # in forward and again in backward): the uploads set the pace, so the H2D
  # line shows how close they run to the measured copy rate.
  : > "$out/bench_transfer_bound.log"
  bench bench_transfer_bound.log --shape 1.7B --batch 1 --seq 4096 --microbatches 1 --freeze-linear \
    --memory-cap 8 --warmup 3 --devices cuda:0 --profile "${PROFILE:-2}"
fi
if [ -z "${SKIP_MAX_SEQ:-}" ]; then
  ./build-gpu/roundpipe-bench --shape 1.7B --max-seq --recompute layer --memory-cap 24 \
    --seq-start "${SEQ_START:-16384}" --seq-limit "${SEQ_LIMIT:-131072}" --devices cuda:0 2>&1 | tee "$out/max_seq_1.7B.log"
fi
echo "total: ${SECONDS}s"

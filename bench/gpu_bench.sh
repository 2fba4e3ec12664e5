#!/usr/bin/env bash
# On the GPU machine, in one call: build roundpipe-bench, then for each
# Qwen3 shape print its table next to the GPU-resident HuggingFace run of the
# same shape and settings, and search the longest sequence under a 24 GiB cap.
# Logs go to $OUT. SHAPES, STEPS, DEVICES override the defaults.
set -uo pipefail
out="${OUT:-$PWD/gpu-out}"; mkdir -p "$out"
export PYTHON="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/machine.txt" 2>&1
date -u >> "$out/machine.txt"
SECONDS=0
JOBS=16 scripts/build.sh build-gpu -DROUNDPIPE_BUILD_TESTS=OFF 2>&1 | tail -1 | tee "$out/build.log"
echo "build: ${SECONDS}s" | tee -a "$out/build.log"
steps="${STEPS:-10}"
for shape in ${SHAPES:-1.7B 4B}; do
  ./build-gpu/roundpipe-bench --shape "$shape" --batch 16 --seq 4096 --microbatches 4 --warmup 5 \
    --steps "$steps" --devices "${DEVICES:-cuda}" --verbose --profile "${PROFILE:-2}" \
    2>&1 | tee "$out/bench_$shape.log"
  "$PYTHON" bench/hf_resident_train.py "$shape" 16 4096 4 "$steps" bfloat16 2>&1 | tail -1 | tee -a "$out/bench_$shape.log"
done
if [ -z "${SKIP_MAX_SEQ:-}" ]; then
  ./build-gpu/roundpipe-bench --shape 1.7B --max-seq --recompute layer --memory-cap 24 \
    --devices cuda 2>&1 | tee "$out/max_seq_1.7B.log"
fi

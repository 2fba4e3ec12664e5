#!/usr/bin/env bash
# On the GPU machine, in one call: pip-install the Python package from source
# (as gpu_python.sh does), check padded and packed batches against
# transformers on CUDA (gpu_masks.py), then run bench/consumer_bench.py on
# the configurations of issue 16, each in its own process with its own
# memory cap, and (HF=1) the GPU-resident transformers run of the same 1.7B
# shape (no cap). RUNS overrides the list ("SHAPE CAP BATCH SEQ MASK;...";
# RUNS= runs the mask check alone, SKIP_MASKS=1 skips it; TOKENS sets its
# size, MASK_VARIANTS="default noflash nofused sliding" adds runs without
# the flash kernel or the fused kernels, and with Qwen3's sliding window),
# then roundpipe-train with default settings on
# the 1.7B shape, 16 x 4096 tokens a step, at each cap of TRAIN_CAPS
# (default "24"; empty: none). Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
$py -m pip install -q --no-index --find-links .deps/wheels "scikit-build-core>=0.10" 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/machine.txt"
SECONDS=0
# (With the tools: roundpipe-train comes from the same build.)
JOBS=16 PYTHON=$py scripts/install_python.sh -Ccmake.define.ROUNDPIPE_BUILD_TOOLS=ON \
  > "$out/pip_install.log" 2>&1 || { tail -20 "$out/pip_install.log"; exit 1; }
echo "installed after ${SECONDS}s" | tee "$out/times.txt"
if [ -z "${SKIP_MASKS:-}" ]; then
  for variant in ${MASK_VARIANTS:-default}; do  # default, noflash, nofused
    env_vars=(); [ "$variant" = noflash ] && env_vars=(ROUNDPIPE_NO_FLASH=1)
    [ "$variant" = nofused ] && env_vars=(ROUNDPIPE_FUSED_KERNELS=0)
    [ "$variant" = sliding ] && env_vars=(WINDOW=1024)
    echo "masks, $variant:" | tee -a "$out/gpu_masks.log"
    env "${env_vars[@]}" timeout 200 $py bench/gpu_masks.py "${TOKENS:-32768}" 2>&1 | tee -a "$out/gpu_masks.log"
    echo "  (${SECONDS}s)" >> "$out/gpu_masks.log"
  done
fi
runs="${RUNS-1.7B 24 16 4096 ones;1.7B 12 16 4096 ones;4B 24 16 4096 ones;llama3-3B 24 16 4096 ones;1.7B 0 16 4096 ones;1.7B 24 1 65536 ones}"
IFS=';' read -ra list <<< "$runs"
for run in "${list[@]}"; do
  timeout "${RUN_TIMEOUT:-120}" $py bench/consumer_bench.py $run "${STEPS:-6}" 2>&1 | tee -a "$out/consumer.log" | grep -v "^  " | tail -3
  echo "  (exit ${PIPESTATUS[0]}, ${SECONDS}s)" | tee -a "$out/consumer.log"
done
train_bin=$(find build/python -name roundpipe-train -type f | head -1)
for cap in ${TRAIN_CAPS-24}; do
  data="$out/../train-data"; mkdir -p "$data"
  # The 1.7B shape's config.json, and 96 rows of 4096 random tokens.
  [ -f "$data/config.json" ] || $py bench/consumer_bench.py --write-train-data "$data" 96 4096
  timeout "${RUN_TIMEOUT:-120}" "$train_bin" --config "$data/config.json" --data "$data/data.jsonl" \
    --batch-size 16 --seq-len 4096 --microbatches 4 --dtype float16 --steps "${STEPS:-6}" \
    --log-every 1 --devices "cuda,mem=${cap}GiB" --output "$data/out" --overwrite 2>&1 \
    | tee -a "$out/train.log" | grep -E "step|summary|device memory|plan" | tail -6
  echo "  (roundpipe-train cap ${cap} GiB: exit ${PIPESTATUS[0]}, ${SECONDS}s)" | tee -a "$out/train.log"
done
[ -n "${HF:-}" ] && timeout 150 $py bench/hf_resident_train.py 1.7B 16 4096 4 5 float16 2>&1 | tail -2 | tee "$out/hf_resident.log"
echo "total ${SECONDS}s"

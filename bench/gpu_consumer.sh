#!/usr/bin/env bash
# On the GPU machine, in one call: pip-install the Python package from source
# (as gpu_python.sh does), check padded and packed batches against
# transformers on CUDA (gpu_masks.py), then run bench/consumer_bench.py on
# the configurations of issue 16, each in its own process with its own
# memory cap, and (HF=1) the GPU-resident transformers run of the same 1.7B
# shape (no cap). RUNS overrides the list ("SHAPE CAP BATCH SEQ MASK;...";
# RUNS= runs the mask check alone, SKIP_MASKS=1 skips it; TOKENS sets its
# size, MASK_VARIANTS="default noflash nofused" adds runs without the flash
# kernel or the fused kernels). Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
$py -m pip install -q --no-index --find-links .deps/wheels "scikit-build-core>=0.10" 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/machine.txt"
SECONDS=0
JOBS=16 PYTHON=$py scripts/install_python.sh > "$out/pip_install.log" 2>&1 || { tail -20 "$out/pip_install.log"; exit 1; }
echo "installed after ${SECONDS}s" | tee "$out/times.txt"
if [ -z "${SKIP_MASKS:-}" ]; then
  for variant in ${MASK_VARIANTS:-default}; do  # default, noflash, nofused
    env_vars=(); [ "$variant" = noflash ] && env_vars=(ROUNDPIPE_NO_FLASH=1)
    [ "$variant" = nofused ] && env_vars=(ROUNDPIPE_FUSED_KERNELS=0)
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
[ -n "${HF:-}" ] && timeout 150 $py bench/hf_resident_train.py 1.7B 16 4096 4 5 float16 2>&1 | tail -2 | tee "$out/hf_resident.log"
echo "total ${SECONDS}s"

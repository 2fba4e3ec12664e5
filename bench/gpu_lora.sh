#!/usr/bin/env bash
# On the GPU machine, in one call: pip-install the Python package from source
# (as gpu_python.sh does) and peft (from .deps/wheels: scripts/vendor_deps.sh),
# then bench/lora_bench.py, each configuration in its own process:
#   PART="8B 14B" runs both; PART=8B (default): LoRA on the Qwen3-8B shape, 8 x 4096 tokens a step:
#     GPU-resident peft + transformers with gradient checkpointing (no cap),
#     then RoundPipe under a 24 GiB cap with pin_model alloc, register, off.
#   PART=14B: a random Qwen3-14B-shaped checkpoint written to disk, then LoRA
#     with pin_model=off from its memory-mapped pages under a 24 GiB cap.
# PINS, STEPS, BATCH, SEQ override; SKIP_RESIDENT=1 skips the baseline. Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
source bench/gpu_install.sh
steps="${STEPS:-5}" batch="${BATCH:-8}" seq="${SEQ:-4096}"
run() {  # what, then lora_bench.py arguments
  local what=$1; shift
  timeout "${RUN_TIMEOUT:-150}" $py bench/lora_bench.py "$@" 2>&1 | tee -a "$out/lora.log" | grep -v "^  " | grep -v Warning | tail -2
  echo "  ($what: exit ${PIPESTATUS[0]}, ${SECONDS}s)" | tee -a "$out/lora.log"
}
for part in ${PART:-8B}; do
  if [ "$part" = 8B ]; then
    [ -n "${SKIP_RESIDENT:-}" ] || run resident resident 8B "$batch" "$seq" "$steps"
    for pin in ${PINS:-alloc register off}; do
      run "pin $pin" roundpipe 8B 24 "$batch" "$seq" "$steps" "$pin"
    done
  else
    dir=/tmp/qwen3-14b-random
    [ -f "$dir/config.json" ] || run write write 14B "$dir"
    du -sh "$dir" | tee -a "$out/lora.log"
    run "14B off, mapped" roundpipe 14B 24 "$batch" "$seq" "$steps" off "$dir"
  fi
done
echo "total ${SECONDS}s"

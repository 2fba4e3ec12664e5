#!/usr/bin/env bash
# On the GPU machine, in one call: pip-install the Python package from source
# (as gpu_lora.sh does) and peft (from .deps/wheels: scripts/vendor_deps.sh),
# then bench/moe_bench.py, each configuration in its own process: LoRA on the
# attention projections and the experts of the Qwen3-30B-A3B shape and the
# GPT-OSS-20B shape, GPU-resident peft + transformers (no cap, where it
# fits), then RoundPipe under a 24 GiB cap with the experts as grouped
# products and as a per-expert loop.
# SHAPES, STEPS, BATCH, SEQ override; SKIP_RESIDENT=1 skips the baselines.
# Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
source bench/gpu_install.sh
steps="${STEPS:-4}" batch="${BATCH:-8}" seq="${SEQ:-2048}"
run() {  # what, then moe_bench.py arguments
  local what=$1; shift
  timeout "${RUN_TIMEOUT:-240}" $py bench/moe_bench.py "$@" 2>&1 | tee -a "$out/moe.log" | grep -v "^  " | grep -v Warning | tail -2
  echo "  ($what: exit ${PIPESTATUS[0]}, ${SECONDS}s)" | tee -a "$out/moe.log"
}
for shape in ${SHAPES:-30B-A3B gpt-oss-20b}; do
  [ -n "${SKIP_RESIDENT:-}" ] || run "$shape resident" resident "$shape" "$batch" "$seq" "$steps"
  for grouped in 1 0; do
    run "$shape grouped=$grouped" roundpipe "$shape" 24 "$batch" "$seq" "$steps" "$grouped"
  done
done
echo "total ${SECONDS}s"

#!/usr/bin/env bash
# On the GPU machine, in one call: pip-install the Python package from source
# (as gpu_lora.sh does) and peft (from .deps/wheels: scripts/vendor_deps.sh),
# then bench/moe_bench.py, each configuration in its own process: LoRA on the
# attention projections and the experts of the Qwen3-30B-A3B shape and the
# GPT-OSS-20B shape, GPU-resident peft + transformers (no cap, where it
# fits), then RoundPipe under a 24 GiB cap with the experts as grouped
# products and as a per-expert loop.
# ESTIMATE=1 adds four layers of Qwen3-235B-A22B at 31K tokens; PYTEST=<-k
# expression> runs those tests of test_hf_presets.py and test_lora.py.
# SHAPES, STEPS, BATCH, SEQ, GROUPED ("1 0") override; SKIP_RESIDENT=1 skips
# the baselines. The 30B shape (61 GB of bf16 weights) is pinned in place
# ("register"): "alloc" holds two copies while moving in, over the 128 GB host.
# Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
source bench/gpu_install.sh
# The MoE tests with the cuda backend beside the simulated ones.
[ -z "${PYTEST:-}" ] || timeout 150 $py -m pytest -q -p no:cacheprovider tests/python/test_hf_presets.py \
  tests/python/test_lora.py -k "$PYTEST" 2>&1 | tee "$out/pytest.log" | tail -4
steps="${STEPS:-4}" batch="${BATCH:-8}" seq="${SEQ:-2048}"
run() {  # what, then moe_bench.py arguments
  local what=$1; shift
  timeout "${RUN_TIMEOUT:-240}" $py bench/moe_bench.py "$@" 2>&1 | tee -a "$out/moe.log" | grep -v "^  " | grep -v Warning | tail -2
  echo "  ($what: exit ${PIPESTATUS[0]}, ${SECONDS}s)" | tee -a "$out/moe.log"
}
for shape in ${SHAPES:-30B-A3B gpt-oss-20b}; do
  [ -n "${SKIP_RESIDENT:-}" ] || run "$shape resident" resident "$shape" "$batch" "$seq" "$steps"
  pin=alloc; [ "$shape" = 30B-A3B ] && pin=register
  for grouped in ${GROUPED:-1 0}; do
    run "$shape grouped=$grouped" roundpipe "$shape" 24 "$batch" "$seq" "$steps" "$grouped" "$pin"
  done
done
# Four decoder layers of Qwen3-235B-A22B at the paper's 31K tokens, one
# sequence, for the estimate's per-layer costs (the plan on measured costs).
[ -z "${ESTIMATE:-}" ] || VERBOSE=1 MICROBATCHES=1 run "235B-A22B layers" roundpipe 235B-A22B-4L 24 1 31744 3 1
echo "total ${SECONDS}s"

#!/usr/bin/env bash
# On the GPU machine: data parallel through the Python package (issue 21):
# the Qwen3-1.7B shape (random bf16 weights from bench/make_qwen3_checkpoint.py)
# under torchrun, padded rows with an attention_mask (bench/dp_python_train.py),
# every process capped to a 24 GiB card: one process, then two sharing the
# GPU with replicated and with sharded optimizer state. Logs go to $OUT.
# Env: STEPS (4).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
source bench/gpu_install.sh
steps="${STEPS:-4}"
$py -m pytest -q -p no:cacheprovider tests/python/test_lifecycle.py -k memory_capped 2>&1 | tail -1 | tee "$out/pytest.log"
$py bench/make_qwen3_checkpoint.py /tmp/qwen3-1.7b /tmp/tokens.jsonl 1.7B 4 4096 2>&1 | tail -1 | tee "$out/checkpoint.log"
cores=$(nproc)
run() {  # processes, sharded
  OMP_NUM_THREADS=$((cores / $1)) timeout 200 $py -m torch.distributed.run --standalone --nproc-per-node "$1" \
    bench/dp_python_train.py /tmp/qwen3-1.7b "$steps" "$2" > "$out/dp_python_$1_$2.log" 2>&1
  echo "== $1 process(es), sharded=$2 (exit $?)" | tee -a "$out/summary.txt"
  grep -E "^step |process\(es\)|peak host" "$out/dp_python_$1_$2.log" | tee -a "$out/summary.txt"
}
run 1 0
run 2 0
run 2 1
echo "done after ${SECONDS}s" | tee -a "$out/times.txt"

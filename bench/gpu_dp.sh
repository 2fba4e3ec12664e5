#!/usr/bin/env bash
# On the GPU machine: data parallel roundpipe-train under torchrun (issue
# 21) on the Qwen3-1.7B workload (random bf16 weights from
# bench/make_qwen3_checkpoint.py, full fine-tuning, fp32 Adam on the CPU,
# 16 x 4096 tokens a step, every process capped to a 24 GiB card). With one
# GPU both processes share it: this shows the C++ data-parallel path on
# CUDA and measures what the gradients' all-reduce costs on loopback Gloo
# (the "network" here), not scaling. Logs go to $OUT (or ./bench-out).
# Each run's processes report their peak host memory (bench/peak_rss.py).
# Env: STEPS (6), PROCS (2), LORA (0: full fine-tuning; r: LoRA rank r),
# RUNS (the data-parallel runs: float32, bfloat16, sharded = float32
# gradients with --shard-optimizer-state).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
export PYTHON="${PYTHON:-python3}"
JOBS=16 scripts/build.sh build-gpu 2>&1 | tail -2 | tee "$out/build.log"
./build-gpu/tests/roundpipe_tests --gtest_filter='*DataParallel*' 2>&1 | tail -3 | tee "$out/dp_gtests.log"
steps="${STEPS:-6}"; procs="${PROCS:-2}"; lora="${LORA:-0}"
"$PYTHON" bench/make_qwen3_checkpoint.py /tmp/qwen3-1.7b /tmp/tokens.jsonl 1.7B 64 4096 2>&1 | tail -1 | tee "$out/checkpoint.log"
args=(--model /tmp/qwen3-1.7b --data /tmp/tokens.jsonl --seq-len 4096 --batch-size 16 --steps "$steps"
  --dtype bfloat16 --devices cuda,mem=24GiB --log-every 1 --lr 1e-5 --lora-rank "$lora" --overwrite)
summarize() {  # the steps after the first (warm-up): mean seconds, tokens/s, host memory
  "$PYTHON" - "$1" "$2" <<'PY' | tee -a "$out/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[2] + "/metrics.jsonl") if '"loss"' in l][1:]
s = sum(r["seconds"] for r in rows) / len(rows)
t = sum(r["tokens"] for r in rows) / len(rows)
print(f"{sys.argv[1]}: {s:.2f} s/step, {t / s:,.0f} tokens/s, rank 0 host resident {max(r['host_resident_bytes'] for r in rows) / 2**30:.1f} GiB, "
      f"device peak {max(r['device_peak_bytes'] for r in rows) / 2**30:.2f} GiB, losses {[round(r['loss'], 4) for r in rows]}")
PY
}
"$PYTHON" bench/peak_rss.py ./build-gpu/roundpipe-train "${args[@]}" --output /tmp/dp-one > "$out/one_process.log" 2>&1
tail -4 "$out/one_process.log"; summarize "1 process" /tmp/dp-one
grep -h "peak host resident" "$out/one_process.log" | tee -a "$out/summary.txt"
# torchrun sets OMP_NUM_THREADS=1 unless it is set: the CPU side (Adam,
# gradient copies, the all-reduce's sums) would run on one core each.
cores=$(nproc)
for run in ${RUNS:-float32 bfloat16 sharded}; do
  extra=(--reduce-dtype "$run")
  [ "$run" = sharded ] && extra=(--reduce-dtype float32 --shard-optimizer-state)
  OMP_NUM_THREADS=$((cores / procs)) "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$procs" --no-python \
    "$PYTHON" bench/peak_rss.py ./build-gpu/roundpipe-train "${args[@]}" "${extra[@]}" --output "/tmp/dp-$run" > "$out/dp_$run.log" 2>&1
  tail -4 "$out/dp_$run.log"; summarize "$procs processes sharing the GPU, ${extra[*]}" "/tmp/dp-$run"
  grep -h "peak host resident" "$out/dp_$run.log" | sort | tee -a "$out/summary.txt"
done

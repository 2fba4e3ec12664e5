#!/usr/bin/env bash
# On the GPU machine: build, create a random-weight Qwen3-1.7B-shaped
# checkpoint with transformers, and fine-tune it with roundpipe-train on the
# GPU (bf16 weights, fp32 Adam on the CPU, async step; 16 x 4096 tokens per
# step). Logs go to $OUT (or ./bench-out).
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
export PYTHON="${PYTHON:-python3}"
JOBS=16 scripts/build.sh build-gpu 2>&1 | tail -2 | tee "$out/build.log"
steps="${STEPS:-8}"
"$PYTHON" bench/make_qwen3_checkpoint.py /tmp/qwen3-1.7b /tmp/tokens.jsonl 1.7B 64 4096 2>&1 | tail -1 | tee "$out/checkpoint.log"
./build-gpu/roundpipe-train --model /tmp/qwen3-1.7b --data /tmp/tokens.jsonl --seq-len 4096 \
  --batch-size 16 --steps "$steps" --dtype bfloat16 --devices cuda --log-every 1 --lr 1e-5 \
  --output /tmp/qwen3-1.7b-tuned 2>&1 | tee "$out/train_qwen3_1.7b.log"
ls -la /tmp/qwen3-1.7b-tuned | tee -a "$out/train_qwen3_1.7b.log"

#!/usr/bin/env bash
# On the GPU machine, in one call: QLoRA against LoRA on a full-precision
# base (issue 35). Builds roundpipe-bench, then for each of SHAPES (default
# 8B) runs it with LoRA r=16 on every projection under CAP (default 24 GiB)
# on an NF4 base and on the bf16 base (BASES, default "nf4 bf16"; fp4, int8
# and fp8 too; "nf4/layer_from_stage": that base in that recompute grain,
# --recompute), BATCH x SEQ tokens (16 x 4096), and with RESIDENT=1 the
# GPU-resident peft + bitsandbytes QLoRA of the same shape
# (bench/lora_bench.py resident_qlora, RESIDENT_BATCH rows, default 8).
# Each run prints tokens/s, parameter bytes uploaded per step, peak device
# memory, host memory, and for a quantized base the CUDA dequantization
# checked against the CPU path, the plan's predicted peak and the calls or
# microbatches that ran out of memory (VERBOSE=1: every plan with its
# per-stage memory, and the layers' measured costs; EXTRA: more
# roundpipe-bench options, e.g. --oom-census). Logs go to $OUT (or ./bench-out); a summary
# to qlora.txt.
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
SECONDS=0
BUILD_TARGETS=roundpipe-bench JOBS=16 scripts/build.sh build-gpu -DROUNDPIPE_BUILD_TESTS=OFF > "$out/build.log" 2>&1 ||
  { tail -30 "$out/build.log"; exit 1; }
echo "build: ${SECONDS}s" | tee "$out/qlora.txt"
cap="${CAP:-24}"
for shape in ${SHAPES:-8B}; do
  for run in ${BASES:-nf4 bf16}; do
    base="${run%%/*}"; grain=(); [ "$run" != "$base" ] && grain=(--recompute "${run#*/}")
    quant=(); [ "$base" != bf16 ] && quant=(--quantize-base "$base")
    log="$out/bench_${shape}_${run//\//_}.log"
    timeout "${RUN_TIMEOUT:-240}" stdbuf -oL ./build-gpu/roundpipe-bench --shape "$shape" --devices "cuda,mem=${cap}GiB" \
      --batch "${BATCH:-16}" --seq "${SEQ:-4096}" --warmup "${WARMUP:-2}" --steps "${STEPS:-3}" \
      --lora-rank 16 "${quant[@]}" "${grain[@]}" ${VERBOSE:+--verbose} ${EXTRA:-} > "$log" 2>&1
    echo "== $shape $run base, LoRA r16, cap $cap GiB (exit $?, ${SECONDS}s)" | tee -a "$out/qlora.txt"
    grep -E "oom census|model made|dequantization|one-byte-a-thread|tokens/s|H2D bytes|peak device|predicted peak|recoveries|host peak|host arena|parameters|host pinned" "$log" \
      | tee -a "$out/qlora.txt"
  done
done
if [ -n "${RESIDENT:-}" ]; then
  $py -m pip install -q --no-index --no-deps --find-links .deps/wheels peft==0.21.2 accelerate psutil \
    bitsandbytes==0.50.2 2>&1 | tail -1
  for shape in ${SHAPES:-8B}; do
    # (16 x 4096 tokens' fp32 logits alone take 37 GiB there: 8 rows by default.)
    timeout "${RUN_TIMEOUT:-240}" $py bench/lora_bench.py resident_qlora "$shape" "${RESIDENT_BATCH:-8}" "${SEQ:-4096}" \
      "${STEPS:-3}" > "$out/resident_qlora_$shape.log" 2>&1
    echo "== resident peft + bitsandbytes QLoRA $shape (exit $?, ${SECONDS}s)" | tee -a "$out/qlora.txt"
    grep -E "step|resident|Error" "$out/resident_qlora_$shape.log" | tail -5 | tee -a "$out/qlora.txt"
  done
fi
echo "total ${SECONDS}s" | tee -a "$out/qlora.txt"

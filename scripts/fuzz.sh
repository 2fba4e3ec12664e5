#!/usr/bin/env bash
# Builds the libFuzzer target for the safetensors header parser with clang
# (ASan + UBSan) and runs it for a bounded time. Usage: scripts/fuzz.sh [seconds]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-30}"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
torch="$("$PYTHON" -c 'import torch, os; print(os.path.dirname(torch.__file__))')"
out="$root/build/fuzz"; mkdir -p "$out/corpus"
cp "$root"/tests/fuzz/corpus/* "$out/corpus/"
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root/include" -I"$torch/include" -I"$torch/include/torch/csrc/api/include" \
  "$root/tests/fuzz/safetensors_header_fuzz.cpp" "$root/src/io/safetensors.cpp" \
  -L"$torch/lib" -Wl,-rpath,"$torch/lib" -lc10 -ltorch_cpu -o "$out/safetensors_header_fuzz"
"$out/safetensors_header_fuzz" -max_total_time="$seconds" -max_len=4096 -timeout=5 "$out/corpus" 2>&1 | tail -4

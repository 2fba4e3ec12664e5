#!/usr/bin/env bash
# Copies the Debian GoogleTest sources, the nlohmann-json and gloo headers (and more) into
# .deps/ (ignored by git) for machines without those packages, like the GPU
# machine: carry .deps with the device tool.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f /usr/src/googletest/CMakeLists.txt ] || { echo "install googletest (scripts/setup.sh)"; exit 1; }
rm -rf "$root/.deps"; mkdir -p "$root/.deps/nlohmann_json/include"
cp -r /usr/src/googletest "$root/.deps/googletest"
cp -r /usr/include/nlohmann "$root/.deps/nlohmann_json/include/"
mkdir -p "$root/.deps/benchmark/include" "$root/.deps/benchmark/lib"
cp -r /usr/include/benchmark "$root/.deps/benchmark/include/"
cp -L /usr/lib/x86_64-linux-gnu/libbenchmark.so "$root/.deps/benchmark/lib/libbenchmark.so"
mkdir -p "$root/.deps/cli11/include"
cp -r /usr/include/CLI "$root/.deps/cli11/include/"
# gloo's headers (LibTorch's Gloo process group declares itself with them).
mkdir -p "$root/.deps/gloo/include"
cp -r /usr/include/gloo "$root/.deps/gloo/include/"
# Wheels for the Python package's build backend and tests (the GPU machine
# has no network): pure-Python, for any Python 3 version.
mkdir -p "$root/.deps/wheels"
"${PYTHON:-$root/.venv/bin/python}" -m pip download -q --only-binary=:all: --dest "$root/.deps/wheels" \
  "scikit-build-core>=0.10" pytest
for v in 3.10 3.12 3.13; do
  "${PYTHON:-$root/.venv/bin/python}" -m pip download -q --only-binary=:all: --python-version "$v" \
    --dest "$root/.deps/wheels" "scikit-build-core>=0.10" pytest || true
done
# peft for the LoRA benchmark and tests (pure Python, and what it needs that
# an environment with torch and transformers may lack).
"${PYTHON:-$root/.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: \
  --dest "$root/.deps/wheels" peft==0.21.2 accelerate psutil
# bitsandbytes for the GPU-resident QLoRA baseline (bench/lora_bench.py
# resident_qlora), slimmed to its CPU and CUDA 13.0 libraries (the wheel
# carries every CUDA and ROCm build, 43 MB; the device tool carries 64 MiB).
"${PYTHON:-$root/.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: \
  --dest "$root/.deps/bnb-full" bitsandbytes==0.50.2
"${PYTHON:-$root/.venv/bin/python}" - "$root/.deps/bnb-full" "$root/.deps/wheels" <<'PY'
import base64, csv, hashlib, io, pathlib, re, sys, zipfile
keep = re.compile(r"libbitsandbytes_(cpu|cuda130)\.so$")
for src in pathlib.Path(sys.argv[1]).glob("bitsandbytes-*.whl"):
    dst = pathlib.Path(sys.argv[2]) / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        names = [n for n in zin.namelist() if not n.endswith(".so") or keep.search(n)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = [r for r in csv.reader(io.StringIO(zin.read(record).decode())) if r and r[0] in names]
        for n in names:
            if n != record:
                zout.writestr(zin.getinfo(n), zin.read(n))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        zout.writestr(record, text.getvalue())
PY
rm -rf "$root/.deps/bnb-full"
# The original RoundPipe (and what it needs beyond torch, transformers and
# tqdm), for bench/gpu_user.sh's side-by-side runs: pure Python (its CPU
# Adam compiles at first use with torch's ninja build).
mkdir -p "$root/.deps/original"
"${PYTHON:-$root/.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: \
  --dest "$root/.deps/original" roundpipe==0.1.1 beartype py-cpuinfo
# It calls transformers 4's masking API (create_causal_mask(input_embeds=...)):
# transformers 4.57 and what it pins, installed beside it only.
"${PYTHON:-$root/.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$root/.deps/original" \
  "transformers<5" "huggingface_hub<1.0" "tokenizers<0.23,>=0.22"

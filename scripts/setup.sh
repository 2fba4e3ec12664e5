#!/usr/bin/env bash
# Installs everything roundpipe needs on a fresh Debian machine:
# system packages (compiler tools, C++ libraries) and a project-local
# Python virtual environment (.venv) with torch==2.11.0, whose LibTorch we
# build against. Safe to run again: every step is skipped when done.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

apt_packages=(cmake ninja-build ccache g++ libgtest-dev libgmock-dev
  libbenchmark-dev nlohmann-json3-dev libcli11-dev libfmt-dev libgloo-dev clang-format clang libclang-rt-14-dev)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($python_bin --version)"
  "$python_bin" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.11.0")' 2>/dev/null; then
  echo "[setup] installing torch==2.11.0 into .venv (large download, cached by pip)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.11.0 numpy
fi
# The model-preset tests compare with HuggingFace transformers (CPU).
if ! .venv/bin/python -c 'import transformers, sys; sys.exit(transformers.__version__ != "5.17.0")' 2>/dev/null; then
  echo "[setup] installing transformers==5.17.0 into .venv (test oracle for the model presets)"
  .venv/bin/python -m pip install -q transformers==5.17.0 safetensors
fi
# The LoRA tests compare with peft (on transformers, CPU).
if ! .venv/bin/python -c 'import peft, sys; sys.exit(peft.__version__ != "0.21.2")' 2>/dev/null; then
  echo "[setup] installing peft==0.21.2 into .venv (test oracle for LoRA on the presets)"
  .venv/bin/python -m pip install -q peft==0.21.2 "torch==2.11.0" "transformers==5.17.0"
fi
# The 4-bit base-weight tests compare with bitsandbytes (its CPU path).
if ! .venv/bin/python -c 'import bitsandbytes, sys; sys.exit(bitsandbytes.__version__ != "0.50.2")' 2>/dev/null; then
  echo "[setup] installing bitsandbytes==0.50.2 into .venv (test oracle for 4-bit base weights)"
  .venv/bin/python -m pip install -q bitsandbytes==0.50.2 "torch==2.11.0"
fi
# roundpipe.prepare reads local files with datasets; roundpipe.plot draws
# with matplotlib; roundpipe.train writes TensorBoard events when
# tensorboard is there (the tests check all three).
if ! .venv/bin/python -c 'import datasets, matplotlib, tensorboard, sys; sys.exit(datasets.__version__ != "5.2.0")' 2>/dev/null; then
  echo "[setup] installing datasets, matplotlib and tensorboard into .venv (data preparation, plots, metrics)"
  .venv/bin/python -m pip install -q datasets==5.2.0 matplotlib==3.11.2 tensorboard==2.21.0 "torch==2.11.0" "transformers==5.17.0"
fi
# The Python package builds with scikit-build-core against the .venv's torch
# (pip install --no-build-isolation .); its tests run with pytest.
if ! .venv/bin/python -c 'import scikit_build_core, pytest' 2>/dev/null; then
  echo "[setup] installing scikit-build-core and pytest into .venv"
  .venv/bin/python -m pip install -q "scikit-build-core>=0.10" pytest
fi
echo "[setup] done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"

#!/usr/bin/env bash
# Configures and builds roundpipe against the torch of $PYTHON (default: the
# project's .venv, else python3). Usage: scripts/build.sh [build dir] [extra cmake args]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"; shift || true
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
prefix="$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
jobs="${JOBS:-$(nproc)}"
# ccache hits across build directories (this one and the Python package's).
export CCACHE_BASEDIR="$root"
# No GPU here to detect: name the architecture (H200 = 9.0) so configuring needs none.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$PYTHON" "$@" >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "$jobs" ${BUILD_TARGETS:+--target $BUILD_TARGETS}

#!/usr/bin/env bash
# Builds and installs the Python package `roundpipe` into the project's .venv
# (or $PYTHON's environment) against the torch installed there. The build
# directory (build/python) is kept, so rebuilding is incremental.
# Usage: scripts/install_python.sh [extra pip args, e.g. -e for development]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
# ccache hits across the C++ build and this one (same sources, other build dir).
export CCACHE_BASEDIR="$root"
export CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-$(nproc)}"
"$PYTHON" -m pip install -q --no-build-isolation --no-deps "$@" "$root" \
  || { echo "pip install failed; rerun with -v for the build log" >&2; exit 1; }
"$PYTHON" -c 'import roundpipe; print("[install_python] roundpipe", roundpipe.__version__, "from", roundpipe.__file__)'

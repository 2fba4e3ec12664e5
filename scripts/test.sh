#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite: the C++
# tests (CTest), the installed C++ package (scripts/check_install.sh: the
# README's example built against `cmake --install`'s tree only), then the
# Python package (pip install into .venv) and its tests (pytest). Every
# engine test runs on simulated devices (sim:1, sim:2, sim:3) and, where GPUs
# are visible, on CUDA too. Arguments go to ctest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build"
(cd "$root/build" && ctest --output-on-failure -j "${CTEST_JOBS:-2}" "$@")
"$root/scripts/check_install.sh" "$root/build"
"$root/scripts/install_python.sh"
cd "$root"
.venv/bin/python -m pytest -q tests/python

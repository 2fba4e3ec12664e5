#!/usr/bin/env bash
# Copies the Debian GoogleTest sources and the nlohmann-json header into
# .deps/ (ignored by git) for machines without those packages, like the GPU
# machine: carry .deps with the device tool.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f /usr/src/googletest/CMakeLists.txt ] || { echo "install googletest (scripts/setup.sh)"; exit 1; }
rm -rf "$root/.deps"; mkdir -p "$root/.deps/nlohmann_json/include"
cp -r /usr/src/googletest "$root/.deps/googletest"
cp -r /usr/include/nlohmann "$root/.deps/nlohmann_json/include/"

#!/usr/bin/env bash
# Copies the Debian GoogleTest sources into .deps/ (ignored by git) so that a
# machine without the package, like the GPU machine, can build the tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f /usr/src/googletest/CMakeLists.txt ] || { echo "install googletest (apt-get install googletest)"; exit 1; }
rm -rf "$root/.deps/googletest"; mkdir -p "$root/.deps"
cp -r /usr/src/googletest "$root/.deps/googletest"

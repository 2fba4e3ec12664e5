#!/usr/bin/env bash
# Builds the library, roundpipe-train and the C++ tests with AddressSanitizer
# and UndefinedBehaviorSanitizer (in build-sanitize/) and runs the CTest
# suite on simulated devices. Any sanitizer report fails the run. Not part of
# CI (about 3x the time of the plain suite); run it after changes to the
# engine, the IO code or the CLI. Arguments go to ctest (e.g. -R Trainer).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-sanitize"
"$root/scripts/setup.sh" >/dev/null
# -O1 with line tables (-g1): readable reports at a fraction of -O2 -g's build time.
flags="-O1 -g1 -fsanitize=address,undefined -fno-sanitize-recover=undefined"
flags="$flags -fno-omit-frame-pointer"
# vptr checks need RTTI of every polymorphic class involved, and LibTorch's
# own libraries are not built with the sanitizers: leave that one check out.
flags="$flags -fno-sanitize=vptr"
"$root/scripts/build.sh" "$build" -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined"
# Leaks: LibTorch and CPython keep global state until exit, which LeakSanitizer
# reports as leaks of theirs; leak checking is left to the tests' own
# memory checks. Everything else aborts at the first report.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export ROUNDPIPE_TEST_BACKENDS="${ROUNDPIPE_TEST_BACKENDS:-sim:1;sim:2,jitter_us=150;sim:3,jitter_us=150,chunk=16KiB}"
cd "$build"
# The fuzz target is its own sanitized build (scripts/fuzz.sh).
ctest --output-on-failure -j "${CTEST_JOBS:-2}" -E safetensors_header_fuzz "$@" 2>&1 |
  tee "$build/sanitize.log"
if grep -qE "ERROR: AddressSanitizer|runtime error:" "$build/sanitize.log"; then
  echo "[sanitize] sanitizer reports above (full log: $build/sanitize.log)"
  exit 1
fi
echo "[sanitize] no sanitizer reports"

#!/usr/bin/env bash
# Checks the installed C++ package: `cmake --install` of a built tree into a
# fresh prefix (then moved, to show it is relocatable), then the README's
# example built by examples/install_consumer against that prefix and torch's
# CMake prefix only, and run on two simulated devices.
# Usage: scripts/check_install.sh [build dir, default build]
# Cheap: installing copies the built library and headers; the consumer is one
# translation unit (a ccache hit after the first run: its paths stay the same).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
torch_prefix="$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
work="$build/install-check"
rm -rf "$work"
mkdir -p "$work"

cmake --install "$build" --prefix "$work/staged" >"$work/install.log"
mv "$work/staged" "$work/prefix"
prefix="$work/prefix"

# Only public headers installed, and none of them includes a header that is not.
for internal in host_arena.h ivalue_tree.h parallel.h rng.h atomic_directory.h; do
  if [ -e "$prefix/include/roundpipe/$internal" ]; then
    echo "check_install: internal header installed: include/roundpipe/$internal" >&2; exit 1
  fi
done
missing=0
while read -r file header; do
  if [ ! -e "$prefix/include/$header" ]; then
    echo "check_install: ${file#"$prefix/"} includes $header, which is not installed" >&2
    missing=1
  fi
done < <(grep -rHoE '#include ["<]roundpipe/[^">]+' "$prefix/include/roundpipe" |
  sed -E 's/:#include ["<]/ /')
if grep -rhE '#include "' "$prefix/include/roundpipe" | grep -vE '#include "roundpipe/'; then
  echo "check_install: an installed header includes a header outside include/roundpipe" >&2
  missing=1
fi
[ "$missing" = 0 ]
# The package names no path of this machine (source tree, torch, libstdc++).
if grep -rnE "$root/(include|src|\.deps)|site-packages|/usr/lib/gcc" "$prefix"/lib*/cmake/roundpipe; then
  echo "check_install: the installed CMake package holds paths of the build machine" >&2; exit 1
fi

launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR="$root"
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"  # no GPU needed to configure
cmake -S "$root/examples/install_consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "${launcher[@]}" \
  >"$work/consumer.configure.log" 2>&1 || { cat "$work/consumer.configure.log"; exit 1; }
grep -E '^-- roundpipe ' "$work/consumer.configure.log"
cmake --build "$work/consumer" >"$work/consumer.build.log" 2>&1 ||
  { cat "$work/consumer.build.log"; exit 1; }
# The example compiled against the installed headers, not the source tree's.
if grep -E -- "-I ?$root/(include|src)|-isystem ?$root/(include|src)" "$work/consumer/compile_commands.json" \
  >/dev/null 2>&1; then
  echo "check_install: the consumer compiled against the source tree" >&2; exit 1
fi
ROUNDPIPE_DEVICES=sim:2 "$work/consumer/readme_example" >"$work/run.log" 2>&1 ||
  { cat "$work/run.log"; exit 1; }
tail -n 1 "$work/run.log"
grep -q "step 19 loss" "$work/run.log" ||
  { cat "$work/run.log"; echo "check_install: no 'step 19 loss' line" >&2; exit 1; }
echo "check_install: OK (the README's example built against $prefix only)"

#!/usr/bin/env bash
# Diagnoses a crash of the pytest suite on the GPU machine: installs the
# package, then runs the error path outside and inside pytest. Logs under $OUT.
set -uo pipefail
out="${OUT:-$PWD/gpu-out}"; mkdir -p "$out"
py=python3
$py -m pip install -q --no-index --find-links .deps/wheels "scikit-build-core>=0.10" pytest 2>&1 | tail -2
JOBS=16 PYTHON=$py scripts/install_python.sh -v 2>&1 | grep -E "roundpipe: libstdc|install_python" | tail -3
so=$(ls /opt/torch/.venv/lib/python3.12/site-packages/roundpipe/_C*.so); readelf -d $so | grep NEEDED | head -3; echo "defined _M_insert: $(nm -D -C --defined-only $so | grep -c "ostream::_M_insert")"; ls -la /usr/lib/gcc/x86_64-linux-gnu/*/libstdc++* 2>&1 | head
run() { local name=$1; shift; echo "== $name: $*"; ( timeout 120 "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log" ); grep -v "^$" "$out/$name.log" | head -60 | cut -c1-220; }
run script $py bench/error_path_check.py

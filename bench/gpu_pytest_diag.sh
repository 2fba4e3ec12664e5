#!/usr/bin/env bash
# Diagnoses a crash of the pytest suite on the GPU machine: installs the
# package, then runs subsets in separate processes. Logs under $OUT.
set -uo pipefail
out="${OUT:-$PWD/gpu-out}"; mkdir -p "$out"
py=python3
$py -m pip install -q --no-index --find-links .deps/wheels "scikit-build-core>=0.10" pytest 2>&1 | tail -2
ulimit -s | tee "$out/ulimit.txt"
JOBS=16 PYTHON=$py scripts/install_python.sh 2>&1 | tail -1
run() { local name=$1; shift; echo "== $name: $*"; ( ROUNDPIPE_CRASH_BACKTRACE=1 timeout 120 "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log" ); tail -2 "$out/$name.log"; }
run errors_alone $py -m pytest -q -p no:cacheprovider -p no:faulthandler tests/python/test_errors_and_api.py
run no_cuda env CUDA_VISIBLE_DEVICES= $py -m pytest -q -p no:cacheprovider -p no:faulthandler tests/python
run reap env RP_TEST_REAP=1 $py -X faulthandler -m pytest -q -p no:cacheprovider tests/python/test_auto_split.py tests/python/test_errors_and_api.py
run full_faulthandler $py -X faulthandler -m pytest -q -p no:cacheprovider -v tests/python/test_auto_split.py tests/python/test_errors_and_api.py

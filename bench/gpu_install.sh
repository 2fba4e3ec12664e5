# Sourced by the GPU scripts that run the Python package: peft from
# .deps/wheels (scripts/vendor_deps.sh), the package from source unless it is
# installed (REINSTALL=1 forces it), the machine's versions into
# $out/machine.txt. Expects $out and $py; starts SECONDS.
SECONDS=0
$py -m pip install -q --no-index --find-links .deps/wheels "scikit-build-core>=0.10" peft==0.21.2 pytest 2>&1 | tail -2
# bitsandbytes (slimmed: its CPU and CUDA 13.0 libraries) for the QLoRA baseline.
$py -m pip install -q --no-index --no-deps --find-links .deps/wheels bitsandbytes==0.50.2 2>&1 | tail -1
$py -c 'import peft, transformers, torch; print("peft", peft.__version__, "transformers", transformers.__version__, "torch", torch.__version__)' | tee "$out/machine.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$out/machine.txt"
# The host's CPU and transparent huge pages (first touches of the step's host memory: bench/README.md
# "The current tree on an H200").
{ lscpu | grep -E "^Model name|^CPU\(s\)" | tr -s ' '
  echo "THP enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)," \
    "defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null)"; } >> "$out/machine.txt"
if ! $py -c 'import roundpipe' 2>/dev/null || [ -n "${REINSTALL:-}" ]; then
  JOBS=16 PYTHON=$py scripts/install_python.sh > "$out/pip_install.log" 2>&1 || { tail -20 "$out/pip_install.log"; exit 1; }
fi
echo "installed after ${SECONDS}s" | tee "$out/times.txt"

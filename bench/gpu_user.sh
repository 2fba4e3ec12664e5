#!/usr/bin/env bash
# On the GPU machine, in one call: the consumer table as users get it.
# Installs our package from source (bench/gpu_install.sh, which exports no
# allocator setting) and the original RoundPipe from .deps/original
# (scripts/vendor_deps.sh), then runs bench/user_train.py, the original's
# own benchmark idiom, in the default environment, one process per run:
# each of RUNS (";"-separated "SHAPE CAP BATCH SEQ [ENV=VALUE...]") REPEAT
# times on ours and, where the run matches the regular expression ORIGINAL
# (ORIGINAL=. : every run), once on the original. Prints one line
# per run with the engine's out-of-memory retries counted from its
# warnings; EXITS=N adds N back-to-back short processes (train,
# synchronize, exit; then exit without synchronize) and counts any exit
# status but 0; SCRIPTS="SCRIPT SHAPE CAP ARGS...;..." runs the original's
# benchmark scripts (our copies) on ours and the original (SCRIPT_IMPLS picks); RESIDENT="SHAPE BATCH SEQ STEPS" adds GPU-resident peft LoRA
# (bench/lora_bench.py), PYTEST="ARGS" a pytest run, HOST_PROBE="PART STEPS;..." the host
# memory probe (bench/host_memory_probe.py) beside them; BASE=REGEX runs the matching runs, each
# repeat, on an earlier version of our package too (the source tree in .gpu-base: make it with
# `git archive <commit> | tar -x -C .gpu-base` and carry it), alternating with the current one, for a
# before/after in one call. CONCURRENT=1 runs a repeat's runs at once on the one GPU (GROUP=N: N
# at a time). STOP_AFTER=S starts no run after S seconds (the device's limit is 600 s a call).
# Logs go to $OUT (or ./bench-out): the result lines and the tally in user_runs.txt, every run's
# log in runs.log, the installs' in pip_install.log and install.log.
set -uo pipefail
out="${OUT:-$PWD/bench-out}"; mkdir -p "$out"
py=python3
base_pid=""
if [ -n "${BASE:-}" ] && { [ ! -d /tmp/base/roundpipe ] || [ -n "${REINSTALL:-}" ]; }; then
  # the earlier version, built beside the current one (kept by a warm machine: REINSTALL=1 redoes it)
  ln -sfn ../.deps .gpu-base/.deps
  $py -m pip install -q --no-index --find-links .deps/wheels "scikit-build-core>=0.10" 2>&1 | tail -2
  ( CMAKE_BUILD_PARALLEL_LEVEL=8 $py -m pip install -q --no-build-isolation --no-deps --target /tmp/base ./.gpu-base \
      > "$out/base_install.tmp" 2>&1 || echo "base: install failed" ) & base_pid=$!
fi
source bench/gpu_install.sh
[ -n "$base_pid" ] && { wait "$base_pid"; echo "base installed after ${SECONDS}s";
  cat "$out/base_install.tmp" >> "$out/install.log"; rm -f "$out/base_install.tmp"; }
if [ -n "${ORIGINAL:-}" ]; then
  $py -m pip install -q --no-index --no-deps --target /tmp/original .deps/original/*.whl \
    >> "$out/install.log" 2>&1 || echo "original: install failed"
fi
if [ -n "${HOST_PROBE:-}" ]; then  # "PART STEPS;...": bench/host_memory_probe.py under each cache setting,
  # in the background (CPU only, beside the GPU runs); the table is printed at the end
  IFS=';' read -ra probes <<< "$HOST_PROBE"
  for p in "${probes[@]}"; do
    read -ra pw <<< "$p"
    IFS=';' read -ra envs <<< "${HOST_PROBE_ENVS:-X=0;ONEDNN_PRIMITIVE_CACHE_CAPACITY=8;LRU_CACHE_CAPACITY=8;ONEDNN_PRIMITIVE_CACHE_CAPACITY=8 LRU_CACHE_CAPACITY=8}"
    for env in "${envs[@]}"; do
      ( env $env OMP_NUM_THREADS=2 PYTHONPATH="" timeout 500 $py bench/host_memory_probe.py "${pw[@]}" \
          > "$out/probe_${pw[0]}_$(echo "$env" | tr ' =' '__').log" 2>&1 ) &
    done
  done
fi
runs="${RUNS-1.7B 24 16 4096;1.7B 16 16 4096;1.7B 12 16 4096;4B 24 16 4096;4B 12 16 4096;llama3-3B 24 16 4096}"
IFS=';' read -ra list <<< "$runs"
one() {  # impl log args...
  local impl=$1 log=$2; shift 2
  local pypath=""; [ "$impl" = original ] && pypath=/tmp/original; [ "$impl" = base ] && pypath=/tmp/base
  local shape=$1 cap=$2 batch=$3 seq=$4; shift 4
  env "$@" PYTHONPATH="$pypath" PYTHONUNBUFFERED=1 timeout "${RUN_TIMEOUT:-200}" \
    $py bench/user_train.py "$shape" "$cap" "$batch" "$seq" "${TIMED:-4}" "${WARMUP:-3}" > "$log" 2>&1
  local rc=$?
  local retries; retries=$(grep -c "ran out of memory" "$log")
  local result; result=$(grep "^RESULT" "$log" | sed 's/^RESULT //')
  [ -z "$result" ] && result="impl=$impl shape=$shape cap=$cap env=$(echo "${*:-none}" | tr ' ' ',') FAILED: $(grep -E "Error|error|terminate" "$log" | tail -2 | cut -c1-300 | tr '\n' ' ')"
  [ "$impl" = base ] && result="[base] $result"
  # (137: SIGKILL, which here is the kernel's out-of-memory killer: the host ran out, not the GPU.)
  [ "$rc" = 137 ] && result="$result sigkill=host_out_of_memory_likely"
  echo "$result oom_warnings=$retries unknown_size_warnings=$(grep -c 'unknown size' "$log") exit=$rc (${SECONDS}s)"
  grep -A40 "^  plan:" "$log" | head -40
}
# Each run's log goes into one runs.log (headed by its number) and is removed:
# the device brings back only 8 files, and a call of many runs lost its
# table when one file per run crowded it out (KEEP_RUN_LOGS=1 keeps them).
keep_log() {
  { echo "===== $(basename "$1" .log)"; cat "$1"; } >> "$out/runs.log"
  [ -n "${KEEP_RUN_LOGS:-}" ] || rm -f "$1"
}
# STOP_AFTER=S: start no run (or repeat) after S seconds of this script, so a call ends with its
# table before the device's limit kills it (runs started together are all or none).
time_left() {
  [ -z "${STOP_AFTER:-}" ] || [ "$SECONDS" -lt "$STOP_AFTER" ] && return 0
  echo "skipped: $* (STOP_AFTER=$STOP_AFTER s reached at ${SECONDS}s)"; return 1
}
n=0
if [ -n "${CONCURRENT:-}" ]; then  # each repeat's runs at once, on one GPU: memory and out-of-memory
  # counts hold (each process has its own cap), throughputs do not. The host holds every
  # process's optimizer state at once: four 3-4B runs overfill 128 GiB and are killed (exit 137),
  # and so did one of two Llama-3B-shape runs in each of two pairs (2026-12-07): pair those with 1.7B.
  # GROUP=N: a repeat's runs go N at a time (default: all at once), e.g. GROUP=2 over four
  # workloads runs two pairs one after the other, each repeat.
  group=${GROUP:-${#list[@]}}
  [ "$group" -ge 1 ] 2>/dev/null || { echo "GROUP=$GROUP: give a number of runs >= 1" >&2; exit 2; }
  for r in $(seq 1 "${REPEAT:-1}"); do
    for ((g = 0; g < ${#list[@]}; g += group)); do
      time_left "repeat $r, runs $((g + 1))-$((g + group))" || continue
      pids=(); i=$g
      for run in "${list[@]:g:group}"; do
        read -ra words <<< "$run"; i=$((i + 1))
        one ours "$out/c${r}_$i.log" "${words[@]}" > "$out/c${r}_$i.res" & pids+=($!)
      done
      wait "${pids[@]}"
      for j in $(seq $((g + 1)) $i); do
        echo "repeat $r: $(head -1 "$out/c${r}_$j.res")"
        keep_log "$out/c${r}_$j.log"; rm -f "$out/c${r}_$j.res"
      done
    done
  done | tee "$out/user_runs.txt"
  list=()
fi
for run in "${list[@]}"; do
  read -ra words <<< "$run"
  for r in $(seq 1 "${REPEAT:-1}"); do
    time_left "$run, repeat $r" || continue
    both=""; [ -n "${BASE:-}" ] && [[ "$run" =~ $BASE ]] && both=1
    # (BASE_FIRST=1: the earlier version first, to see an order effect)
    if [ -n "$both" ] && [ -n "${BASE_FIRST:-}" ]; then
      n=$((n + 1)); one base "$out/run$n.log" "${words[@]}"; keep_log "$out/run$n.log"
    fi
    n=$((n + 1)); one ours "$out/run$n.log" "${words[@]}"; keep_log "$out/run$n.log"
    if [ -n "$both" ] && [ -z "${BASE_FIRST:-}" ]; then
      n=$((n + 1)); one base "$out/run$n.log" "${words[@]}"; keep_log "$out/run$n.log"
    fi
  done
  if [ -n "${ORIGINAL:-}" ] && [[ "$run" =~ $ORIGINAL ]] && time_left "$run, original"; then
    n=$((n + 1)); one original "$out/run$n.log" "${words[@]}"; keep_log "$out/run$n.log"
  fi
done | tee -a "$out/user_runs.txt"
if [ -n "${SCRIPTS:-}" ]; then  # "SCRIPT SHAPE CAP ARGS...;...": the original's benchmark scripts
  # (our copies, tests/python/original_scripts) on ours and, with ORIGINAL set, on the original
  IFS=';' read -ra scripts <<< "$SCRIPTS"
  for s in "${scripts[@]}"; do
    read -ra w <<< "$s"
    dir="/tmp/model-${w[1]}"; [ -d "$dir" ] || $py bench/shapes.py "${w[1]}" "$dir"
    for impl in ${SCRIPT_IMPLS:-ours original}; do
      [ "$impl" = original ] && [ -z "${ORIGINAL:-}" ] && continue
      pypath=""; [ "$impl" = original ] && pypath=/tmp/original
      n=$((n + 1)); log="$out/script$n.log"
      PYTHONPATH="$pypath" PYTHONUNBUFFERED=1 timeout "${RUN_TIMEOUT:-300}" $py tests/python/original_scripts/run_script.py \
        "${w[2]}" "tests/python/original_scripts/${w[0]}" "$dir" "${w[@]:3}" > "$log" 2>&1
      rc=$?
      echo "$impl ${w[0]} ${w[1]} cap=${w[2]} args=${w[*]:3}: $(grep -h '^Thoughput' "$log") $(grep -h '^MEMORY' "$log")" \
        "oom_warnings=$(grep -c 'ran out of memory' "$log") exit=$rc (${SECONDS}s)"
      [ $rc -ne 0 ] && grep -E "Error|error" "$log" | tail -2 | cut -c1-300
      keep_log "$log"
    done
  done | tee -a "$out/user_runs.txt"
fi
if [ -n "${EXITS:-}" ]; then
  bad=0
  for i in $(seq 1 "$EXITS"); do
    for sync in 1 0; do
      SYNC=$sync PYTHONUNBUFFERED=1 timeout 120 $py bench/exit_check.py > "$out/exit.log" 2>&1
      rc=$?
      if [ $rc -ne 0 ] || grep -q "terminate called" "$out/exit.log"; then
        bad=$((bad + 1)); echo "exit run $i (synchronize=$sync): status $rc"; tail -3 "$out/exit.log"
      fi
    done
  done
  echo "exits: $((2 * EXITS)) processes, $bad with a status other than 0 (${SECONDS}s)" | tee -a "$out/user_runs.txt"
fi
if [ -n "${RESIDENT:-}" ]; then  # "SHAPE BATCH SEQ STEPS": GPU-resident peft LoRA, no cap (the baseline)
  timeout "${RUN_TIMEOUT:-200}" $py bench/lora_bench.py resident $RESIDENT > "$out/resident.log" 2>&1
  echo "resident peft $RESIDENT: $(grep -v '^  ' "$out/resident.log" | grep -v Warning | tail -1) (${SECONDS}s)" | tee -a "$out/user_runs.txt"
fi
if [ -n "${PYTEST:-}" ]; then  # e.g. "tests/python/test_lifecycle.py -k cuda"
  $py -m pytest -q -p no:cacheprovider $PYTEST 2>&1 | tail -5 | tee -a "$out/user_runs.txt"
fi
if [ -n "${HOST_PROBE:-}" ]; then
  wait
  for f in "$out"/probe_*.log; do echo "$(basename "$f"): $(grep -h '^cpu:' "$f") $(grep -h '^GROWTH' "$f")" \
    "rss by step: $(grep -h '^RSS' "$f" | sed 's/.*mib=//' | tr '\n' ' ')"; done \
    | tee -a "$out/user_runs.txt"
  lscpu | grep -E "Model name|Flags" | cut -c1-400 >> "$out/user_runs.txt"
fi
# Runs, warnings, failures and peaks by workload (bench/tally_runs.py), from every line above.
[ -s "$out/user_runs.txt" ] && $py bench/tally_runs.py "$out/user_runs.txt"
echo "total ${SECONDS}s"

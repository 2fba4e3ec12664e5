#!/usr/bin/env bash
# The main job on its built-in default: installs what is missing, builds, and
# fine-tunes a small Qwen3-architecture model (configs/qwen3-tiny) through
# RoundPipe with roundpipe-train on a generated task (reversing 4-letter
# words), on every device there is (simulated ones on a CPU-only machine; set
# ROUNDPIPE_DEVICES, e.g. sim:3 or cuda). Prints the loss falling and the
# held-out accuracy before and after, and saves a HuggingFace checkpoint in
# ./roundpipe-out. Extra arguments go to roundpipe-train (--help lists them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build" >/dev/null
# The tiny model learns fastest with exact (synchronous) optimizer steps;
# large models use the asynchronous default.
exec "$root/build/roundpipe-train" --config "$root/configs/qwen3-tiny/config.json" \
  --task reverse --steps 600 --lr 1e-3 --sync-step --log-every 50 --eval-every 50 "$@"

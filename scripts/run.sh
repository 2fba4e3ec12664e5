#!/usr/bin/env bash
# The main job on its built-in default: installs what is missing, builds, and
# trains the demo model through RoundPipe on every device there is (simulated
# devices on a CPU-only machine; set ROUNDPIPE_DEVICES to choose, e.g. sim:3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" "$root/build" >/dev/null
exec "$root/build/roundpipe-demo" "$@"

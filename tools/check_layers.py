#!/usr/bin/env python3
"""Checks that the includes of src/ point one way, down (docs/architecture.md).

Each folder of src/runtime/ is a layer and includes only the layers below it;
src/device, src/optim, src/io and src/support include nothing of the runtime;
nothing below src/api includes a public header whose definitions live in
src/api. Prints each include that breaks this; exits 1 if there is one.
Usage: tools/check_layers.py [repository root]
"""
import pathlib
import re
import sys

# Lower numbers are lower layers; folders of one number may not include
# each other either (they are independent).
RANK = {
    "support": 0,
    "runtime/values": 1, "runtime/memory": 1, "runtime/planning": 1, "runtime/parallel": 1,
    "runtime/parts": 2,
    "runtime/recovery": 3,
    "runtime/stage": 4,
    "runtime/engine": 5,
}
# Public headers declaring what src/api defines.
API_HEADERS = {"roundpipe/roundpipe.h", "roundpipe/distributed.h", "roundpipe/wrap.h"}


def layer_of(path):
    for name in sorted(RANK, key=len, reverse=True):
        if path.startswith(name + "/"):
            return name
    return None


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    src = root / "src"
    bad = []
    for file in sorted(src.rglob("*")):
        if file.suffix not in (".h", ".cpp", ".cu"):
            continue
        rel = file.relative_to(src).as_posix()
        mine = layer_of(rel)
        for include in re.findall(r'#include "([^"]+)"', file.read_text()):
            other = layer_of(include)
            if mine and other and other != mine and RANK[other] >= RANK[mine]:
                bad.append(f"{rel}: includes {include} ({other} is not below {mine})")
            if rel.startswith("runtime/") and include in API_HEADERS:
                bad.append(f"{rel}: includes {include}, which src/api defines")
            if rel.split("/")[0] in ("device", "optim", "io", "support") and \
                    include.startswith("runtime/"):
                bad.append(f"{rel}: includes {include} (the runtime is above it)")
            if rel.startswith("support/") and include.split("/")[0] in ("device", "optim", "io"):
                bad.append(f"{rel}: includes {include} (support is the bottom layer)")
            if rel.startswith("device/") and include.startswith("optim/"):
                bad.append(f"{rel}: includes {include} (optim is not below device)")
    for line in bad:
        print(line)
    print(f"{len(bad)} include(s) against the layers")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

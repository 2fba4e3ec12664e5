"""Token files: tokenised datasets that roundpipe-train (C++) and
roundpipe.train map from disk. The layout is Note [Token file] in
include/roundpipe/train/token_file.h:

    b"RPTOKEN1", uint64 header length, header JSON,
    then the sections the header names ([byte offset, byte length]):
    offsets int64[n + 1], input_ids int32[tokens], trained uint8[tokens]

``trained[t]`` is 1 where token t is a label (the loss predicts it), 0 where
it is context (label -100).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

import numpy as np

MAGIC = b"RPTOKEN1"
VERSION = 1
_ALIGN = 64


def fnv1a64(data: bytes) -> str:
    """FNV-1a 64 of ``data`` as 16 hex digits (the C++ loader's
    fingerprint: it compares tokenizers and chat templates by it)."""
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


@dataclass
class Example:
    input_ids: List[int]
    trained: List[int]  # 1: a label, 0: context

    @property
    def labels(self) -> List[int]:
        return [t if m else -100 for t, m in zip(self.input_ids, self.trained)]


def write_token_file(path: str, examples: Iterable[Example], metadata: dict) -> dict:
    """Writes ``examples`` to ``path`` (atomically: a temporary file renamed
    into place) with ``metadata`` in the header; returns the header."""
    offsets = [0]
    ids_parts, mask_parts = [], []
    max_id = -1
    for ex in examples:
        if len(ex.input_ids) != len(ex.trained):
            raise ValueError("an example's input_ids and trained mask differ in length")
        if not ex.input_ids:
            continue
        ids = np.asarray(ex.input_ids, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= 2**31:
            raise ValueError(f"token ids must be in [0, 2^31), got {ids.min()}..{ids.max()}")
        max_id = max(max_id, int(ids.max()))
        ids_parts.append(ids.astype(np.int32))
        mask_parts.append(np.asarray(ex.trained, dtype=np.uint8))
        offsets.append(offsets[-1] + len(ids))
    if len(offsets) == 1:
        raise ValueError("no examples to write: every one was empty")
    ids = np.concatenate(ids_parts)
    mask = np.concatenate(mask_parts)
    offsets = np.asarray(offsets, dtype=np.int64)

    header = dict(metadata)
    header.update(format="roundpipe-tokens", version=VERSION, num_examples=len(offsets) - 1,
                  num_tokens=int(len(ids)), max_token_id=max_id,
                  trained_tokens=int(mask.sum()))
    arrays = [("offsets", offsets), ("input_ids", ids), ("trained", mask)]

    def layout(header_bytes: int):
        sections, at = {}, 16 + header_bytes
        for name, array in arrays:
            at = (at + _ALIGN - 1) // _ALIGN * _ALIGN
            sections[name] = [at, int(array.nbytes)]
            at += array.nbytes
        return sections

    # The header holds the sections' offsets, which depend on its length:
    # reserve room, then pad the JSON to it.
    header["sections"] = layout(0)
    text = json.dumps(header).encode()
    reserved = len(text) + 256
    header["sections"] = layout(reserved)
    text = json.dumps(header).encode()
    text += b" " * (reserved - len(text))
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(np.uint64(len(text)).tobytes())
        f.write(text)
        for name, array in arrays:
            f.seek(header["sections"][name][0])
            f.write(array.tobytes())
    os.replace(tmp, path)
    return header


class TokenFile(Sequence):
    """A token file mapped from disk: ``len()`` examples, each an
    :class:`Example` read on access. The reader is roundpipe-train's (C++,
    ``roundpipe._C.TokenFile``): it checks the file as it maps it."""

    def __init__(self, path: str, max_tokens: Optional[int] = None):
        from . import _C
        self.path = path
        self.max_tokens = max_tokens
        self.native = _C.TokenFile(os.fspath(path), max_tokens)  # ValueError naming what is wrong
        self.header = json.loads(self.native.header_json)

    def __len__(self) -> int:
        return len(self.native)

    def __getitem__(self, index: int) -> Example:
        if not -len(self) <= index < len(self):
            raise IndexError(f"example {index} of {len(self)}")
        input_ids, trained = self.native.example(index % len(self))
        return Example(input_ids, trained)

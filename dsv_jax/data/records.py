"""One ArrayRecord record = one training sample: named numpy arrays plus a small JSON dict.

Layout: b"DSV1", header length (uint32 little endian), the JSON header
{"arrays": {name: [dtype, shape, offset, nbytes]}, "meta": {...}}, then the raw array bytes.
Reading is zero-copy (np.frombuffer) and needs nothing but numpy.
"""

from __future__ import annotations

import json
import struct

import numpy as np

MAGIC = b"DSV1"


def pack(arrays: dict[str, np.ndarray], meta: dict | None = None) -> bytes:
    layout, chunks, offset = {}, [], 0
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        layout[name] = [arr.dtype.str, list(arr.shape), offset, arr.nbytes]
        chunks.append(arr.tobytes())
        offset += arr.nbytes
    header = json.dumps({"arrays": layout, "meta": meta or {}}).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *chunks])


def unpack(record: bytes) -> tuple[dict[str, np.ndarray], dict]:
    if record[:4] != MAGIC:
        raise ValueError(f"not a dsv-jax record (starts with {bytes(record[:4])!r})")
    (n,) = struct.unpack("<I", record[4:8])
    header = json.loads(record[8 : 8 + n])
    body = memoryview(record)[8 + n :]
    arrays = {
        name: np.frombuffer(body[off : off + size], dtype=np.dtype(dt)).reshape(shape)
        for name, (dt, shape, off, size) in header["arrays"].items()
    }
    return arrays, header["meta"]

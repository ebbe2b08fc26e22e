"""wsync's manifest: SHA-256 over the ordered structural records of what a publication
carries (name, dtype, shape, element count, byte count), no payload bytes. The encoding,
version 1, is host/manifest.h's; a receipt's manifest computed here equals the host's.

    preamble   the 18 ASCII bytes "wsync-manifest-v1\\n"
    per record u32 name length, name (UTF-8); u32 dtype-name length, dtype name;
               u32 dimensions, u64 per dimension; u64 elements; u64 bytes
    trailer    u64 record count          (integers little-endian, no padding)
"""
from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

#: Bytes per element of each dtype name wsync knows (host/dtype.c).
ELEMENT_BYTES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2, "int32": 4,
    "int64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}

MAX_DIMS = 8
PREAMBLE = b"wsync-manifest-v1\n"


class Manifest:
    """A manifest fed one record at a time; ``hexdigest()`` ends it."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256(PREAMBLE)
        self.count = 0
        self.bytes = 0

    def add(self, name: str, dtype: str, shape: Sequence[int]) -> None:
        if dtype not in ELEMENT_BYTES:
            raise ValueError(f"{name}: dtype {dtype!r} is not one wsync knows ({', '.join(sorted(ELEMENT_BYTES))})")
        if len(shape) > MAX_DIMS or any(not isinstance(size, int) or size < 0 for size in shape):
            raise ValueError(f"{name}: shape {list(shape)} is not at most {MAX_DIMS} sizes >= 0")
        elements = 1
        for size in shape:
            elements *= size
        encoded_name, encoded_dtype = name.encode(), dtype.encode()
        self._hash.update(struct.pack("<I", len(encoded_name)) + encoded_name
                          + struct.pack("<I", len(encoded_dtype)) + encoded_dtype
                          + struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
                          + struct.pack("<QQ", elements, elements * ELEMENT_BYTES[dtype]))
        self.count += 1
        self.bytes += elements * ELEMENT_BYTES[dtype]

    def hexdigest(self) -> str:
        final = self._hash.copy()
        final.update(struct.pack("<Q", self.count))
        return final.hexdigest()


def digest(records: Iterable[tuple[str, str, Sequence[int]]]) -> str:
    """The manifest of (name, dtype, shape) records, in order."""
    manifest = Manifest()
    for name, dtype, shape in records:
        manifest.add(name, dtype, shape)
    return manifest.hexdigest()

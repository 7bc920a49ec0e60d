"""FNV-1a 64 over raw buffer bytes: the hash of every probe and dump line.

Must equal the seed's C/CUDA loop byte for byte::

    h = 0xcbf29ce484222325; for each byte b: h ^= b; h *= 0x100000001b3 (mod 2^64)

Arrays are hashed as their C-contiguous little-endian bytes, so a
transposed view or a big-endian array hashes like the buffer a GPU kernel
would write for the same values.
"""
from __future__ import annotations

import sys

import numpy as np
from fnv_c.ext._fnv import ffi, lib

OFFSET_BASIS = 0xCBF29CE484222325
PRIME = 0x100000001B3

# Below this size copying via tobytes() beats ffi.from_buffer's fixed cost;
# above it the copy dominates. Measured from_buffer vs tobytes per call:
# 8 B +60%, 2 KiB +3%, 8 KiB -19%, 600 KiB -5%.
_ZERO_COPY_BYTES = 8192

# Little-endian numeric dtypes hash their bytes as they are. A set lookup
# is cheaper than inspecting the dtype, and a token hashes ~530 small
# arrays, so per-call overhead is a large share of the cost.
_PLAIN = {np.dtype(t) for t in ("<f2", "<f4", "<f8", "i1", "<i2", "<i4", "<i8",
                                "u1", "<u2", "<u4", "<u8", "?")}


def _normalise(a: np.ndarray) -> np.ndarray:
    if a.dtype.hasobject:
        raise TypeError("fnv1a64: object arrays have no raw bytes to hash")
    bo = a.dtype.byteorder
    if bo == ">" or (bo == "=" and sys.byteorder == "big"):
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a)


def fnv1a64(buf) -> int:
    """FNV-1a 64 of a bytes-like object or of a numpy array's raw bytes."""
    if isinstance(buf, np.ndarray):
        if buf.dtype not in _PLAIN or not buf.flags.c_contiguous:
            buf = _normalise(buf)
        n = buf.nbytes
        if n >= _ZERO_COPY_BYTES:
            return lib.fnv1a_64(ffi.from_buffer(buf), n)
        return lib.fnv1a_64(buf.tobytes(), n)
    if isinstance(buf, bytes):
        return lib.fnv1a_64(buf, len(buf))
    if isinstance(buf, (bytearray, memoryview)):
        mv = memoryview(buf).cast("B")
        return lib.fnv1a_64(ffi.from_buffer(mv), mv.nbytes)
    raise TypeError(f"fnv1a64 wants bytes or a numpy array, got {type(buf).__name__}")


def hex16(h: int) -> str:
    """The dump file's hash spelling: 16 lowercase hex digits."""
    if not 0 <= h < 1 << 64:
        raise ValueError(f"hash {h!r} is not an unsigned 64-bit value")
    return f"{h:016x}"

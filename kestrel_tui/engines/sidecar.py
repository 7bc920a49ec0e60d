"""The raw-values sidecar: an append-only file of tensors by key, read while it grows.

A record is one ASCII header line, then the tensor's bytes, little-endian, C order::

    <tag> <dtype> <shape> <nbytes>\\n<nbytes raw bytes>

``dtype`` is one of DTYPES (``f32``, ``i8``, ...), ``shape`` the dims joined by
commas (``8,64``; a scalar is ``1``), ``nbytes`` = product(shape) * itemsize —
redundant on purpose, so a wrong header is caught at its record instead of
shifting every record after it. There is no file header, so a writer that
opens the file in append mode per record (as the seed's dump writer does per
line) needs no state. A C engine writes one with fprintf + fwrite
(docs/engines-process.md).
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from ..readers import open_regular

DTYPES: dict[str, str] = {
    "f32": "<f4", "f16": "<f2", "f64": "<f8", "bf16": "<u2",
    "i8": "i1", "u8": "u1", "i16": "<i2", "u16": "<u2", "i32": "<i4", "u32": "<u4", "i64": "<i8", "u64": "<u8",
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "bf16"}
MAX_HEADER = 512          # bytes, newline included: a longer "line" means this is not a sidecar
MAX_RECORD = 2**31        # bytes of one tensor; a bigger header is corrupt, not a tensor to wait for
MAX_DIMS = 8
_TAG_RE = re.compile(r"[\x21-\x7e]+")
_SHAPE_RE = re.compile(r"[1-9][0-9]{0,9}(,[1-9][0-9]{0,9}){0,%d}" % (MAX_DIMS - 1))


class SidecarError(ValueError):
    """Bad sidecar content; the message is one line naming the file and the byte offset."""


def dtype_name(dtype: np.dtype) -> str:
    """The sidecar's name for a numpy dtype (bf16 has none in numpy: widen or write u16 yourself)."""
    try:
        return _NAMES[np.dtype(dtype).newbyteorder("<")]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no sidecar name; use one of {', '.join(DTYPES)}") from None


def write_record(f: BinaryIO, tag: str, array: np.ndarray) -> None:
    """Append one record (the Python writer; flush before the key's dump line, see the docs)."""
    a = np.ascontiguousarray(array)
    name = dtype_name(a.dtype)
    a = a.astype(DTYPES[name], copy=False)
    shape = ",".join(map(str, a.shape or (1,)))
    f.write(f"{tag} {name} {shape} {a.nbytes}\n".encode("ascii"))
    f.write(a.tobytes())


def _parse_header(line: bytes) -> tuple[str, str, tuple[int, ...], int] | str:
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        return "non-ASCII bytes in the header (is this a sidecar file?)"
    parts = text.split(" ")
    if len(parts) != 4:
        return f"{len(parts)} fields, expected '<tag> <dtype> <shape> <nbytes>'"
    tag, dt, shape_s, n_s = parts
    if not _TAG_RE.fullmatch(tag):
        return f"bad tag {tag[:40]!r}"
    if dt not in DTYPES:
        return f"unknown dtype {dt[:20]!r}; use one of {', '.join(DTYPES)}"
    if not _SHAPE_RE.fullmatch(shape_s):
        return f"bad shape {shape_s[:40]!r}; dims joined by commas like 8,64 (a scalar is 1)"
    if not n_s.isdigit() or len(n_s) > 12:
        return f"bad byte count {n_s[:20]!r}"
    shape = tuple(int(d) for d in shape_s.split(","))
    want = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dt]).itemsize
    if int(n_s) != want:
        return f"byte count {n_s} does not match {dt} {shape_s} ({want} bytes)"
    if want > MAX_RECORD:
        return f"record of {want} bytes is beyond the {MAX_RECORD}-byte limit"
    return tag, dt, shape, want


def _decode(dt: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    a = np.frombuffer(data, dtype=DTYPES[dt]).reshape(shape)
    if dt == "bf16":  # numpy has no bfloat16: widen exactly to f32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.dtype(DTYPES[dt]).newbyteorder("="), copy=True)


READ_CHUNK = 64 * 2**20  # bytes read per poll


class SidecarReader:
    """Reads the records a growing file holds so far; a record shows once all its bytes are there."""

    def __init__(self, path: str | os.PathLike, label: str | None = None):
        self.path = os.fspath(path)
        self.label = label or self.path
        self._f: BinaryIO | None = None
        self._buf = bytearray()
        self._offset = 0  # file offset of _buf[0]
        self.caught_up = True  # the last poll read everything the file held then

    def _error(self, offset: int, why: str) -> SidecarError:
        return SidecarError(f"{self.label}: offset {offset}: {why}")

    def poll(self, max_bytes: int = READ_CHUNK) -> Iterator[tuple[str, np.ndarray, int]]:
        """(tag, array, offset) of each record completed since the last call, reading at most ``max_bytes``
        (a reader that fell behind catches up a chunk at a time: memory stays bounded; see caught_up)."""
        if self._f is None:
            try:
                self._f = open_regular(self.path)  # a FIFO put there by the engine is refused, not waited on
            except FileNotFoundError:
                return
            except OSError as e:
                raise self._error(0, f"cannot read it ({e.strerror or e})") from None
        chunk = self._f.read(max_bytes)
        self.caught_up = len(chunk) < max_bytes
        if chunk:
            self._buf += chunk
        while True:
            nl = self._buf.find(b"\n", 0, MAX_HEADER)
            if nl < 0:
                if len(self._buf) >= MAX_HEADER:
                    raise self._error(self._offset, f"no header line within {MAX_HEADER} bytes"
                                                    f" (expected '<tag> <dtype> <shape> <nbytes>')")
                return
            parsed = _parse_header(bytes(self._buf[:nl]))
            if isinstance(parsed, str):
                raise self._error(self._offset, f"bad record header: {parsed}")
            tag, dt, shape, n = parsed
            if len(self._buf) < nl + 1 + n:
                return  # the bytes are still being written
            data = bytes(self._buf[nl + 1:nl + 1 + n])
            offset = self._offset
            del self._buf[:nl + 1 + n]
            self._offset += nl + 1 + n
            yield tag, _decode(dt, shape, data), offset

    def pending(self) -> str | None:
        """What an unfinished trailing record lacks (None: the file ends at a record boundary)."""
        if not self._buf:
            return None
        nl = self._buf.find(b"\n", 0, MAX_HEADER)
        if nl < 0:
            return f"the file ends inside a record header ({len(self._buf)} bytes)"
        parsed = _parse_header(bytes(self._buf[:nl]))
        if isinstance(parsed, str):
            return f"bad record header: {parsed}"
        tag, _, _, n = parsed
        return f"record {tag!r} is truncated: {len(self._buf) - nl - 1} of {n} bytes"

    def check_end(self) -> None:
        """At the writer's clean exit: a trailing partial record is an error."""
        problem = self.pending()
        if problem:
            raise self._error(self._offset, problem)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_sidecar(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A whole sidecar file, {tag: array} in file order; raises SidecarError."""
    r = SidecarReader(path)
    if not os.path.isfile(path):
        raise SidecarError(f"{path}: no such sidecar file")
    try:
        out: dict[str, np.ndarray] = {}
        for tag, a, off in r.poll():
            if tag in out:
                raise r._error(off, f"duplicate key {tag!r}")
            out[tag] = a
        r.check_end()
        return out
    finally:
        r.close()

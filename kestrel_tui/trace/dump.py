"""L2 dump files: the seed's ``VLLM_L2_DUMP`` text format.

One line per key, appended in dataflow order::

    <tag> <hash16>\\n

``tag`` is printable ASCII without spaces (``t32_l0_ks``; other engines'
tags are kept as they are), one space, then exactly 16 hex digits. The
writer emits lowercase; the reader also accepts uppercase (normalised to an
int), ignores a trailing ``\\r`` on any line (CRLF files) and blank lines at
the end of the file. Anything else — including a blank line in the middle —
is an error that names the file and line, because a silently skipped line
would move the "first DIFF".

Dumps are evidence: a writer never truncates or replaces an existing file.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable

from ..errors import UsageError
from .fnv import hex16

_TAG_RE = re.compile(r"[\x21-\x7e]+")
_HEX16_RE = re.compile(r"[0-9A-Fa-f]{16}")


class DumpError(UsageError):
    """A dump file that cannot be written or read; the message is one line."""


def _check_tag(tag: str) -> str | None:
    if not isinstance(tag, str) or not tag:
        return "empty tag"
    if not _TAG_RE.fullmatch(tag):
        return f"bad characters in tag {_clip(tag)} (printable ASCII, no spaces)"
    return None


def _clip(s: str, n: int = 60) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


class DumpWriter:
    """Appends ``<tag> <hash16>`` lines to a new file (exclusive create)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            # newline="" keeps "\n" on every platform: the format is byte-defined.
            self._f = open(self.path, "x", encoding="ascii", newline="")
        except FileExistsError:
            raise DumpError(f"{self.path}: file exists; dumps are never overwritten, "
                            f"choose another path") from None
        except OSError as e:
            raise DumpError(f"{self.path}: cannot create dump file: {e.strerror}") from None
        self._seen: set[str] = set()

    def write(self, tag: str, h: int) -> None:
        # Refuse what read_dump would refuse, so every file we write reads back.
        problem = _check_tag(tag)
        if problem:
            raise DumpError(f"{self.path}: {problem}")
        if tag in self._seen:
            raise DumpError(f"{self.path}: duplicate key {tag!r}")
        try:
            line = f"{tag} {hex16(int(h))}\n"
        except (TypeError, ValueError) as e:
            raise DumpError(f"{self.path}: key {tag!r}: {e}") from None
        self._seen.add(tag)
        self._f.write(line)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_dump(path: str | os.PathLike, items: Iterable[tuple[str, int]]) -> None:
    with DumpWriter(path) as w:
        for tag, h in items:
            w.write(tag, h)


def _parse_line(line: str) -> tuple[str, int] | str:
    """(tag, hash) or a reason why the line is malformed."""
    if not line.strip():
        return "blank line (blank lines are only allowed at the end of the file)"
    parts = line.split(" ")
    if len(parts) != 2:
        return f"expected 2 fields '<tag> <hash16>' separated by one space, got {len(parts)}"
    tag, hx = parts
    problem = _check_tag(tag)
    if problem:
        return problem
    if not _HEX16_RE.fullmatch(hx):
        if re.fullmatch(r"[0-9A-Fa-f]+", hx):
            return f"hash {_clip(hx)} has {len(hx)} hex digits, expected 16"
        return f"hash {_clip(hx)} is not hexadecimal"
    return tag, int(hx, 16)


def read_dump(path: str | os.PathLike) -> dict[str, int]:
    """Read a dump into ``{tag: hash}`` in file order; raises DumpError."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DumpError(f"{path}: cannot read dump file: {e.strerror}") from None
    lines = raw.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise DumpError(f"{path}: empty dump file (no '<tag> <hash16>' lines)")
    out: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for n, bline in enumerate(lines, start=1):
        if bline.endswith(b"\r"):
            bline = bline[:-1]
        try:
            line = bline.decode("ascii")
        except UnicodeDecodeError:
            raise DumpError(f"{path}:{n}: non-ASCII bytes in line") from None
        parsed = _parse_line(line)
        if isinstance(parsed, str):
            raise DumpError(f"{path}:{n}: malformed line: {parsed}")
        tag, h = parsed
        if tag in out:
            raise DumpError(f"{path}:{n}: duplicate key {tag!r} (first at line {first_line[tag]})")
        out[tag] = h
        first_line[tag] = n
    return out

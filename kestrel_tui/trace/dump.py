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

import contextlib
import os
import re
from collections.abc import Iterable

from ..errors import UsageError
from ..files import create_whole, is_partial_name
from ..readers import open_regular
from .fnv import hex16
from .keys import index_problem

_TAG_RE = re.compile(r"[\x21-\x7e]+")
_HEX16_RE = re.compile(r"[0-9A-Fa-f]{16}")


class DumpError(UsageError):
    """A dump file that cannot be written or read; the message is one line."""


def _check_tag(tag: str) -> str | None:
    if not isinstance(tag, str) or not tag:
        return "empty tag"
    if not _TAG_RE.fullmatch(tag):
        return f"bad characters in tag {_clip(tag)} (printable ASCII, no spaces)"
    return index_problem(tag)


def _clip(s: str, n: int = 60) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


class DumpWriter:
    """Writes ``<tag> <hash16>`` lines to a new file that appears only when complete.

    Until ``close`` (or the end of the ``with`` block) the lines go to a hidden
    temporary file beside ``path``; an exception or Ctrl-C keeps it as
    ``<path>.partial`` (files.py), which read_dump refuses.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._stack = contextlib.ExitStack()
        try:
            self._f = self._stack.enter_context(create_whole(self.path, encoding="ascii", what="dump"))
        except UsageError as e:
            raise DumpError(str(e)) from None
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
        """Publish the file (it is whole now)."""
        self._stack.close()

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, *exc) -> bool:
        # hand the exception to create_whole, which keeps the partial file and re-raises
        return self._stack.__exit__(*exc)


def write_dump(path: str | os.PathLike, items: Iterable[tuple[str, int]]) -> None:
    with DumpWriter(path) as w:
        for tag, h in items:
            w.write(tag, h)


def _parse_line(line: str) -> tuple[str, int] | str:
    """(tag, hash) or the reason why the line is malformed, naming the character at fault."""
    if not line.strip(" "):
        return "blank line (blank lines are only allowed at the end of the file)"
    for col, ch in enumerate(line, start=1):
        if ch == "\t":
            return f"tab at column {col}; separate tag and hash with one space"
        if ch == "\r":
            return f"carriage return at column {col} (a lone CR; line ends must be LF or CRLF)"
        if not " " <= ch <= "~":
            return f"control character {ord(ch):#04x} at column {col}"
    if line.startswith(" "):
        return "line starts with a space; expected '<tag> <hash16>'"
    if line.endswith(" "):
        return "trailing space after the hash"
    tag, sep, hx = line.partition(" ")
    if not sep:
        return "no space: expected '<tag> <hash16>'"
    if hx.startswith(" "):
        return "more than one space between tag and hash"
    if " " in hx:
        return f"{hx.count(' ') + 2} fields; expected '<tag> <hash16>' (a tag has no spaces)"
    problem = _check_tag(tag)
    if problem:
        return problem
    if not _HEX16_RE.fullmatch(hx):
        if re.fullmatch(r"[0-9A-Fa-f]+", hx):
            return f"hash {_clip(hx)} has {len(hx)} hex digits, expected 16"
        return f"hash {_clip(hx)} is not hexadecimal"
    return tag, int(hx, 16)


def _decode(path: str, n: int, bline: bytes) -> str:
    try:
        return bline.decode("ascii")
    except UnicodeDecodeError as e:
        if n == 1 and bline.startswith(b"\xef\xbb\xbf"):
            raise DumpError(f"{path}:1: the file starts with a UTF-8 byte-order mark (BOM); "
                            f"save it without one") from None
        raise DumpError(f"{path}:{n}: non-ASCII byte {bline[e.start]:#04x} at column {e.start + 1}; "
                        f"dump lines are ASCII") from None


def parse_dump_line(path: str, n: int, bline: bytes) -> tuple[str, int]:
    """Line ``n`` of ``path`` (bytes, without its LF; a CRLF's CR is dropped) -> (tag, hash); raises DumpError.
    The one line rule, shared by read_dump and by the process engine's reader of a growing dump."""
    if bline.endswith(b"\r"):
        bline = bline[:-1]
    parsed = _parse_line(_decode(path, n, bline))
    if isinstance(parsed, str):
        raise DumpError(f"{path}:{n}: malformed line: {parsed}")
    return parsed


def read_dump(path: str | os.PathLike) -> dict[str, int]:
    """Read a dump into ``{tag: hash}`` in file order; raises DumpError."""
    path = os.fspath(path)
    if is_partial_name(path) and os.path.isfile(path):
        raise DumpError(f"{path}: a partial dump (its run was interrupted before the end); "
                        f"run the dump again")
    try:
        with open_regular(path) as f:  # a FIFO or device given to diff is refused, not read forever
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
        tag, h = parse_dump_line(path, n, bline)
        if tag in out:
            raise DumpError(f"{path}:{n}: duplicate key {tag!r} (first at line {first_line[tag]})")
        out[tag] = h
        first_line[tag] = n
    return out

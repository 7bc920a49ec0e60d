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
MAX_TAG = 256           # characters of a tag: the longest module path an engine names fits several times
MAX_LINE = 4096         # bytes of one dump line: a tag and its hash fit many times
READ_CHUNK = 1 << 20    # bytes read at a time: a reader that falls behind catches up chunk by chunk
_HEX16_RE = re.compile(r"[0-9A-Fa-f]{16}")


class DumpError(UsageError):
    """A dump file that cannot be written or read; the message is one line."""


def _check_tag(tag: str) -> str | None:
    if not isinstance(tag, str) or not tag:
        return "empty tag"
    if len(tag) > MAX_TAG:
        return f"a tag of {len(tag)} characters, {_clip(tag)} (a tag has at most {MAX_TAG})"
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
    """Read a dump into ``{tag: hash}`` in file order; raises DumpError. Read in bounded chunks
    (``DumpTail``): a file of one enormous line fails at that line, not after holding it whole."""
    path = os.fspath(path)
    if is_partial_name(path) and os.path.isfile(path):
        raise DumpError(f"{path}: a partial dump (its run was interrupted before the end); "
                        f"run the dump again")
    out: dict[str, int] = {}
    first_line: dict[str, int] = {}

    def add(lines) -> None:
        for n, tag, h in lines:
            if tag in out:
                raise DumpError(f"{path}:{n}: duplicate key {_clip(tag)} (first at line {first_line[tag]})")
            out[tag] = h
            first_line[tag] = n

    tail = DumpTail(path)
    try:
        while True:
            add(tail.poll())
            if tail.caught_up:
                break
        add(tail.finish())
    finally:
        tail.close()
    if not out:
        raise DumpError(f"{path}: empty dump file (no '<tag> <hash16>' lines)")
    return out


class DumpTail:
    """The complete lines a growing dump file holds so far, parsed: (line number, tag, hash).

    Read in chunks of ``max_bytes`` (``caught_up`` says whether the last poll reached the end), and a
    line may hold ``MAX_LINE`` bytes: a file that is no dump (one line of gigabytes) fails at once,
    naming its line, instead of being held in memory whole."""

    def __init__(self, path: str, max_bytes: int = READ_CHUNK, opener=open_regular):
        self.path, self.max_bytes, self._open = path, max_bytes, opener
        self._f = None
        self._buf = b""
        self._n = 0            # lines consumed
        self._blank: int | None = None  # a blank line is fine only if nothing but blank lines follows
        self.n_lines = 0       # key lines read
        self.caught_up = True

    def _too_long(self, n: int) -> DumpError:
        return DumpError(f"{self.path}:{n}: a line longer than {MAX_LINE} bytes; a dump line is"
                         f" '<tag> <hash16>' (is this a dump file?)")

    def _lines(self, blines: list[bytes]) -> list[tuple[int, str, int]]:
        out = []
        for b in blines:
            self._n += 1
            if len(b) > MAX_LINE:
                raise self._too_long(self._n)
            if not b.rstrip(b"\r").strip():
                self._blank = self._blank or self._n
                continue
            if self._blank is not None:
                parse_dump_line(self.path, self._blank, b"")  # raises read_dump's blank-line error
            tag, h = parse_dump_line(self.path, self._n, b)
            out.append((self._n, tag, h))
        self.n_lines += len(out)
        return out

    def poll(self) -> list[tuple[int, str, int]]:
        try:
            if self._f is None:
                self._f = self._open(self.path)  # a FIFO or device is refused here, not read forever
            chunk = self._f.read(self.max_bytes)
        except OSError as e:
            raise DumpError(f"{self.path}: cannot read dump file: {e.strerror or e}") from None
        self.caught_up = len(chunk) < self.max_bytes
        if not chunk:
            return []
        self._buf += chunk
        *complete, self._buf = self._buf.split(b"\n")
        out = self._lines(complete)
        if len(self._buf) > MAX_LINE:
            raise self._too_long(self._n + 1)
        return out

    def finish(self) -> list[tuple[int, str, int]]:
        """At a clean exit: a last line without "\\n" counts (read_dump accepts it too)."""
        rest, self._buf = self._buf, b""
        return self._lines([rest]) if rest.strip() else []

    def close(self):
        if self._f is not None:
            self._f.close()

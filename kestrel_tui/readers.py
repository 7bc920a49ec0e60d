"""Files that come from outside (models, configs, profiles, dumps), read with bounds.

A path where a file is expected may name a FIFO, a terminal or /dev/zero: opening
the first blocks until some writer comes, reading the last never ends. So files
are opened without blocking and refused unless they are regular, and read up to
a size cap. The JSON and TOML parsers recurse once per nesting level and
Python's int() refuses more than 4300 digits, both with exceptions no caller
expects; a config nested thousands deep or a number of thousands of digits is
damage, not data, so both are refused here in one line.

Open and read failures are OSError (``NotRegular`` and ``TooLarge`` included), so
a caller keeps its own message for a missing file; JSON beyond the limits is
``LimitError`` (a ValueError); TOML beyond them is a UsageError naming the file.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import tomllib
from typing import BinaryIO

from .errors import UsageError

MAX_DEPTH = 64  # arrays / objects / tables; real configs and profiles nest a few levels
MAX_DIGITS = 100  # an integer in a config or profile is a count or a size: 20 digits hold any of them


class NotRegular(OSError):
    """A FIFO, device, socket or directory where a file is expected."""


class TooLarge(OSError):
    """A file larger than its kind can be."""


class LimitError(ValueError):
    """Text nested deeper, or holding longer integers, than a config can."""


def kind_of(mode: int) -> str:
    """What a non-regular st_mode is, as a noun phrase ("a FIFO")."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def _refuse(mode: int, path) -> OSError:
    if stat.S_ISDIR(mode):
        return IsADirectoryError(errno.EISDIR, "is a directory, not a file", os.fspath(path))
    return NotRegular(errno.EINVAL, f"it is {kind_of(mode)}, not a regular file", os.fspath(path))


def check_regular(path) -> os.stat_result:
    """stat(path), raising NotRegular / IsADirectoryError unless it is a regular file (for paths that a
    library opens by name)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(st.st_mode, path)
    return st


def open_regular(path) -> BinaryIO:
    """A regular file opened for binary reading; anything else is refused before a byte is read.
    O_NONBLOCK: opening a FIFO would otherwise wait for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(st.st_mode, path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def read_regular(path, limit: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most `limit` bytes (TooLarge beyond: a file that grows while
    it is read is cut at the cap, never followed)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise TooLarge(errno.EFBIG, f"{_size(size)}, more than a {what} can be ({_size(limit)})",
                           os.fspath(path))
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(errno.EFBIG, f"more than a {what} can be ({_size(limit)})", os.fspath(path))
    return data


# ---------------------------------------------------------------- JSON

def _json_int(s: str) -> int:
    digits = len(s.lstrip("-"))
    if digits > MAX_DIGITS:
        raise LimitError(f"an integer of {digits} digits ({s[:12]}...); no count or size has more than"
                         f" {MAX_DIGITS}")
    return int(s)


def depth_problem(doc) -> str | None:
    """Why `doc` (parsed JSON or TOML) nests too deep, or None; iterative, so any depth is safe."""
    stack = [(doc, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        if d > MAX_DEPTH:
            return f"nested more than {MAX_DEPTH} levels deep"
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return None


def parse_json(data: bytes | str):
    """json.loads with the limits: LimitError for nesting beyond MAX_DEPTH or an integer longer than
    MAX_DIGITS; json.JSONDecodeError / UnicodeDecodeError as json.loads raises them."""
    try:
        doc = json.loads(data, parse_int=_json_int)
    except RecursionError:
        raise LimitError(f"nested more than {MAX_DEPTH} levels deep") from None
    problem = depth_problem(doc)
    if problem:
        raise LimitError(problem)
    return doc


# ---------------------------------------------------------------- TOML

_LONG_INT = re.compile(r"[0-9][0-9_]{%d,}" % MAX_DIGITS)
_STRINGS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'')


def _first_deep_line(text: str) -> int | None:
    """The line where [ and { (outside one-line strings and comments) first open more than MAX_DEPTH
    levels: where to point for a nesting that tomllib's recursion could not parse."""
    depth = 0
    for n, line in enumerate(text.splitlines(), start=1):
        line = _STRINGS.sub("", line).split("#", 1)[0]
        for ch in line:
            if ch in "[{":
                depth += 1
                if depth > MAX_DEPTH:
                    return n
            elif ch in "]}":
                depth = max(0, depth - 1)
    return None


def parse_toml(text: str, shown: str) -> dict:
    """tomllib.loads with the limits: nesting beyond MAX_DEPTH (arrays, inline tables, dotted keys)
    and integers longer than MAX_DIGITS are a UsageError "FILE[:LINE]: ..."; a syntax error stays
    tomllib.TOMLDecodeError for the caller's own message."""
    def refuse(problem: str, line: int | None, fix: str) -> UsageError:
        return UsageError(f"{shown}{'' if line is None else f':{line}'}: {problem}; {fix}")

    try:
        doc = tomllib.loads(text)
    except RecursionError:
        raise refuse(f"arrays or inline tables nested more than {MAX_DEPTH} levels deep", _first_deep_line(text),
                     "the file is damaged or not a profile") from None
    except tomllib.TOMLDecodeError:
        raise
    except ValueError:  # int() of more digits than Python converts
        m = _LONG_INT.search(text)
        line = text.count("\n", 0, m.start()) + 1 if m else None
        raise refuse(f"an integer of more than {MAX_DIGITS} digits", line,
                     "write the number it should be (counts and sizes have a few digits)") from None
    problem = depth_problem(doc)
    if problem:
        raise refuse(f"tables or arrays {problem}", None, "the file is damaged or not a profile")
    stack = [doc]
    while stack:  # a long integer that int() still converted
        v = stack.pop()
        for x in (v.values() if isinstance(v, dict) else v):
            if isinstance(x, (dict, list)):
                stack.append(x)
            elif isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 3.33 * MAX_DIGITS:
                m = _LONG_INT.search(text)
                line = text.count("\n", 0, m.start()) + 1 if m else None
                raise refuse(f"an integer of more than {MAX_DIGITS} digits", line,
                             "write the number it should be (counts and sizes have a few digits)")
    return doc

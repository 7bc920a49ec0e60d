"""Files the project writes are whole or not there, and never replace anything.

A file is written under a hidden temporary name in its own folder and
published under its real name only once complete, with a hard link, which
fails instead of replacing a file that appeared meanwhile. When writing stops
part way (an error, Ctrl-C), the temporary file is kept as
``<name>.partial`` (``<name>.partial.2``, … when that is taken) so no work is
lost, and the name says it is not a whole file; readers refuse such names.
A temporary file still open when the tool ends (a signal, the app quitting
while a worker writes) is kept as .partial the same way (procs.cleanup).
"""
from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from . import procs
from .errors import UsageError

PARTIAL_SUFFIX = ".partial"


class PartialFileError(UsageError):
    """Writing stopped part way; ``partial`` is where the unfinished file was kept (or None)."""

    def __init__(self, message: str, partial: Path | None):
        super().__init__(message)
        self.partial = partial


def is_partial_name(path: str | os.PathLike) -> bool:
    name = Path(path).name
    stem, dot, n = name.rpartition(".")
    return name.endswith(PARTIAL_SUFFIX) or (n.isdigit() and stem.endswith(PARTIAL_SUFFIX))


def _keep_partial(tmp: Path, final: Path) -> Path | None:
    for n in range(1, 1000):
        cand = final.with_name(final.name + PARTIAL_SUFFIX + ("" if n == 1 else f".{n}"))
        try:
            os.link(tmp, cand)
        except FileExistsError:
            continue
        except OSError:
            return None
        os.unlink(tmp)
        return cand
    return None


def check_new_path(path: str | os.PathLike, what: str = "file") -> Path:
    """The checks worth making before long work: no file there yet, and its folder exists."""
    out = Path(path)
    if out.exists():
        raise UsageError(f"{out}: already exists; kestrel-tui never overwrites a {what} — choose another name")
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent}: no such directory for {out.name}; create it or choose another path")
    return out


def _reserve(path: str | os.PathLike, what: str) -> tuple[Path, Path, int]:
    """Check ``path`` and create its hidden temporary file (O_EXCL): (final, tmp, open fd)."""
    final = check_new_path(path, what)
    tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
    try:
        # not mkstemp: its 0600 would outlive the rename; 0666 & ~umask is what open() gives
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise UsageError(f"{final}: cannot create ({e.strerror}); choose a writable path") from None
    procs.add_file(tmp, lambda: _keep_partial(tmp, final))
    return final, tmp, fd


def _failed(tmp: Path, final: Path, e: BaseException) -> None:
    """Writing stopped with ``e``: keep the temporary file as .partial and raise (always)."""
    procs.drop_file(tmp)
    partial = _keep_partial(tmp, final)
    if partial is None:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    if isinstance(e, (OSError, UsageError)) and not isinstance(e, PartialFileError):
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        kept = f"; the unfinished file is kept as {partial}" if partial else ""
        raise PartialFileError(f"{final}: not written ({reason}){kept}", partial) from None
    e.partial = partial  # type: ignore[attr-defined]  # the CLI prints where it went
    raise e


def _publish(tmp: Path, final: Path) -> None:
    """The whole file goes to its real name, never over a file that appeared meanwhile."""
    procs.drop_file(tmp)
    try:
        os.link(tmp, final)
    except FileExistsError:
        partial = _keep_partial(tmp, final)
        raise PartialFileError(f"{final}: appeared while it was being written; kestrel-tui never overwrites"
                               f" — the new file is kept as {partial}", partial) from None
    except OSError:
        # a filesystem without hard links: rename, after one more check (a tiny race, documented)
        if final.exists():
            partial = _keep_partial(tmp, final)
            raise PartialFileError(f"{final}: appeared while it was being written; the new file is kept"
                                   f" as {partial}", partial) from None
        os.rename(tmp, final)
        return
    os.unlink(tmp)


@contextlib.contextmanager
def create_whole(path: str | os.PathLike, *, text: bool = True, encoding: str = "utf-8",
                 what: str = "file") -> Iterator[IO]:
    """Open a new file for writing; it appears at ``path`` only when the block ends cleanly.

    Raises UsageError when ``path`` exists or cannot be created; when the block
    raises (Ctrl-C included) the unfinished file is kept as ``<path>.partial``
    and PartialFileError (for an OSError or UsageError) or the original
    exception (anything else, e.g. KeyboardInterrupt, with ``.partial`` set)
    propagates.
    """
    final, tmp, fd = _reserve(path, what)
    # newline="" keeps "\n" on every platform: the formats we write are byte-defined.
    f = os.fdopen(fd, "w", encoding=encoding, newline="") if text else os.fdopen(fd, "wb")
    try:
        with f:
            yield f
    except BaseException as e:
        _failed(tmp, final, e)
    _publish(tmp, final)


@contextlib.contextmanager
def create_whole_path(path: str | os.PathLike, *, what: str = "file") -> Iterator[Path]:
    """create_whole for writers that open their output by name (gguf.GGUFWriter): yields the
    hidden temporary path, created empty so that the name is taken; the writer may reopen and
    truncate it, and must have closed it when the block ends. Published and kept as .partial
    exactly as create_whole does."""
    final, tmp, fd = _reserve(path, what)
    os.close(fd)
    try:
        yield tmp
    except BaseException as e:
        _failed(tmp, final, e)
    _publish(tmp, final)

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
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from . import procs
from .errors import UsageError

PARTIAL_SUFFIX = ".partial"
TMP_HEX = 4  # random bytes in a temporary name: .<name>.<8 hex digits>.tmp
NAME_EXTRA = len(".") + 1 + 2 * TMP_HEX + len(".tmp")  # how much longer than its name that is


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
    """The checks worth making before long work: the file system takes the name and the longer names
    it is written under (_reserve, _keep_partial), no file is there yet, and its folder exists.
    Whatever the file system says (a path too long, a file where a folder should be, no permission,
    a symlink loop) is one line."""
    out = Path(path)
    longest = max(NAME_EXTRA, len(PARTIAL_SUFFIX) + len(".999"))
    size, name_max = len(os.fsencode(out.name)), _name_max(out.parent)
    if size + longest > name_max:
        shown = out.name if len(out.name) <= 40 else out.name[:40] + "…"
        raise UsageError(f"{shown}: a name of {size} bytes; this file system takes {name_max}, and kestrel-tui"
                         f" writes the {what} under a name {longest} bytes longer first; shorten it to"
                         f" {name_max - longest} bytes or less")
    try:
        os.lstat(out)  # lstat: a dangling symlink is something there too
    except FileNotFoundError:
        pass
    except OSError as e:
        raise _path_error(out, e) from None
    else:
        raise UsageError(f"{out}: already exists; kestrel-tui never overwrites a {what} — choose another name")
    try:
        folder = os.stat(out.parent)
    except FileNotFoundError:
        raise UsageError(f"{out.parent}: no such directory for {out.name}; create it or choose another path") from None
    except OSError as e:
        raise _path_error(out, e) from None
    if not stat.S_ISDIR(folder.st_mode):
        raise UsageError(f"{out.parent}: not a directory, so it cannot hold {out.name}; choose another path")
    return out


def _name_max(folder: Path) -> int:
    """The longest file name, in bytes, the file system at ``folder`` takes (255, the usual, where it
    will not say: the folder is missing, or the path too long)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _path_error(out: Path, e: OSError) -> UsageError:
    """The file system's refusal of ``out`` as one line, with the way out."""
    fix = {errno.ENAMETOOLONG: "shorten the path", errno.ENOTDIR: "a part of the path is a file, not a folder;"
           " choose another path", errno.EACCES: "choose a folder you may write in",
           errno.ELOOP: "the path goes round a symbolic link loop; choose another path"}
    return UsageError(f"{out}: {e.strerror or e}; {fix.get(e.errno, 'choose another path')}")


def _reserve(path: str | os.PathLike, what: str) -> tuple[Path, Path, int]:
    """Check ``path`` and create its hidden temporary file (O_EXCL): (final, tmp, open fd)."""
    final = check_new_path(path, what)
    tmp = final.with_name(f".{final.name}.{secrets.token_hex(TMP_HEX)}.tmp")
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
        try:
            os.rename(tmp, final)
        except OSError as e:
            partial = _keep_partial(tmp, final)
            kept = f"; the file is kept as {partial}" if partial else ""
            raise PartialFileError(f"{final}: not written ({e.strerror or e}){kept}", partial) from None
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

"""Opening the serving engines' `.pt` files: tensors only, one line for anything else.

Every file is loaded with ``torch.load(weights_only=True)``: torch's restricted unpickler, which
builds tensors, dicts, lists, tuples, strings and numbers and refuses any other global (a class,
a function such as ``os.system``) before it is called. ``mmap=True`` maps the tensors' bytes
instead of reading them, so scanning a folder for its token ids costs a few small reads per
file, whatever the size of the activations beside them.
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path

from ...errors import UsageError
from ...readers import check_regular
from ...text import inert

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_FIX = "torch.save a dict of tensors (the engine's dumper does), or remove the file"


def refused(path: Path | str, problem: str, fix: str = _FIX) -> UsageError:
    return UsageError(f"{inert(str(path))}: {problem}; {fix}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    m = _GLOBAL.search(text)
    if m:
        return f"it names the global {m[1]}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return inert(lines[0] if lines else type(e).__name__, 160)


def load_pt(path: Path | str) -> object:
    """The object a `.pt` file holds, loaded with weights_only=True (tensors mapped, not read)."""
    import torch

    try:
        check_regular(path)
    except FileNotFoundError:
        raise refused(path, "no such file", "check the dump folder") from None
    except OSError as e:
        raise refused(path, f"cannot read it ({e.strerror or e})", "point at the engine's dump folder") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's remarks on pickle protocols would land on the TUI's terminal
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                # the legacy (pre-zip) format cannot be mapped: read it whole
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused(path, f"refused: it holds more than tensors ({_first_line(e)}); only weights_only"
                            f" content is loaded", "regenerate it with the engine's dumper") from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile, KeyError, IndexError,
            AttributeError, TypeError) as e:
        raise refused(path, f"not a torch.save file ({_first_line(e)})", "point at the engine's dump folder"
                      ) from None


def load_dict(path: Path | str) -> dict:
    obj = load_pt(path)
    if not isinstance(obj, dict):
        raise refused(path, f"holds a {type(obj).__name__}, not a dict of tensors by module name")
    for k in obj:
        if not isinstance(k, str):
            raise refused(path, f"has a key of type {type(k).__name__}; the dumpers key tensors by module name")
    return obj


def list_files(folder: Path, pattern: re.Pattern, what: str) -> list[tuple[tuple, Path]]:
    """The regular files of ``folder`` whose names match ``pattern`` (its groups as ints, sorted)."""
    out = []
    try:
        entries = sorted(os.listdir(folder))
    except OSError as e:
        raise refused(folder, f"cannot list it ({e.strerror or e})", f"point at the {what}") from None
    for name in entries:
        m = pattern.fullmatch(name)
        if m:
            out.append((tuple(int(g) for g in m.groups()), folder / name))
    return sorted(out)

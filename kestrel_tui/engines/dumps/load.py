"""Opening the serving engines' `.pt` files: tensors only, each checked as it leaves the file.

Every file is loaded with ``torch.load(weights_only=True)``: torch's restricted unpickler, which
builds tensors, dicts, lists, tuples, strings and numbers and refuses any other global (a class,
a function such as ``os.system``) before it is called. ``mmap=True`` maps the tensors' bytes
instead of reading them, so scanning a folder for its token ids costs a few small reads per
file, whatever the size of the activations beside them.

A mapped tensor's shape is only a claim: a broadcast view (stride 0) of one stored element can
claim 2^40 of them, a sparse or `meta` tensor has no dense bytes at all. So every tensor a file
holds goes through ``check`` before the reader sees it: a plain CPU tensor whose elements are
distinct bytes of its own storage (strided layout, strides that never overlap, in bounds), so its
element count is bounded by the bytes the file holds; of its field's dtype (token ids, positions
and TopK's expert ids integers; activations float32, bfloat16 or float16); and, for the token ids
and positions that the reader loops over and pads up to, every value in [0, 2^31-1], the keys'
own index range. Anything else is one line naming the file and the field.
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...errors import UsageError
from ...readers import check_regular
from ...text import inert
from ...trace.keys import MAX_INDEX

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


# what a field's tensor must hold (check's kind): token ids and positions, integers in [0, MAX_INDEX]; ints,
# integers within int32 as the keys keep them (TopK's expert ids, SGLang's seq_lens); floats, activations;
# None, a tensor no field reads the values of (checked as a tensor, not for its dtype)
_HOLDS = {"ids": ("token ids", 0, MAX_INDEX), "positions": ("positions", 0, MAX_INDEX),
          "ints": ("integers", -(2**31), 2**31 - 1)}
_DENSE = "the dumpers save dense CPU tensors: regenerate the file with the engine's dumper"
_REGENERATE = "regenerate the file with the engine's dumper"


def _dtypes():
    import torch

    ints = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return ints, floats


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The number of storage elements the view spans (1 + its largest offset), or None when two of its
    elements share one (a zero, negative or too-small stride: a broadcast or hand-made view)."""
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides) if sz > 1):
        if stride < span:
            return None
        span += stride * (size - 1)
    return span


def check(t, where: str | Path, field: str, kind: str | None):
    """``t`` if it is a tensor the reader may use as ``kind`` (ids, positions, ints, floats or None: see
    _HOLDS); a one-line UsageError naming
    ``where`` (the file) and ``field`` (its key in the file) otherwise. A non-tensor passes through:
    the reader says what it expected where it reads one."""
    import torch

    if not isinstance(t, torch.Tensor):
        return t

    def no(problem: str, fix: str = _DENSE):
        return refused(where, f"{field} {problem}", fix)

    if t.layout != torch.strided or t.is_sparse or getattr(t, "is_nested", False):
        raise no(f"is a {str(t.layout).replace('torch.', '')} tensor, not a dense one")
    if t.device.type != "cpu":
        raise no(f"is a tensor on device {t.device.type!r} (it holds no values)")
    if t.is_quantized:
        raise no(f"is a quantized tensor ({_name(t.dtype)})")
    shape, strides = tuple(t.shape), tuple(t.stride())
    span = _overlap(shape, strides)
    if span is None:
        raise no(f"is a view whose elements overlap (shape {list(shape)}, strides {list(strides)}: a broadcast"
                 f" or expanded tensor claims more elements than it stores)")
    stored = t.untyped_storage().nbytes() // max(t.element_size(), 1)
    if t.numel() and t.storage_offset() + span > stored:
        raise no(f"reaches past its storage (shape {list(shape)}, offset {t.storage_offset()}, {stored} stored)")
    ints, floats = _dtypes()
    if kind in _HOLDS:
        what, lo, hi = _HOLDS[kind]
        if t.dtype not in ints:
            raise no(f"has dtype {_name(t.dtype)}, but it holds {what}: integers", _REGENERATE)
        if t.numel():
            got_lo, got_hi = int(t.min()), int(t.max())
            if got_lo < lo or got_hi > hi:
                raise no(f"holds {got_lo if got_lo < lo else got_hi}, outside {lo}..{hi} ({what})",
                         "the dump is damaged: regenerate it")
    elif kind == "floats" and t.dtype not in floats:
        why = "; the keys hold float32 values" if t.dtype == torch.float64 else ""
        raise no(f"has dtype {_name(t.dtype)}{why}, but it is an activation: float32, bfloat16 or float16",
                 _REGENERATE)
    return t


def index_vector(t) -> np.ndarray:
    """A checked ids / positions tensor as an int64 array of its own: a view would keep the file's mapping
    alive for as long as the token index lives (one mapping a file, past the system's limit on mappings)."""
    return np.array(t.numpy(), dtype=np.int64, copy=True)


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


def load_dict(path: Path | str, kind_of: Callable[[str, int | None], str | None]) -> dict:
    """A pass file's dict of module path -> tensor (or a tuple output's list of tensors), every tensor
    checked as ``kind_of(key, its index in the list or None)`` says (check's kinds)."""
    obj = load_pt(path)
    if not isinstance(obj, dict):
        raise refused(path, f"holds a {type(obj).__name__}, not a dict of tensors by module name")
    for k, v in obj.items():
        if not isinstance(k, str):
            raise refused(path, f"has a key of type {type(k).__name__}; the dumpers key tensors by module name")
        if isinstance(v, (list, tuple)):
            for j, item in enumerate(v):
                check(item, path, f"{inert(k, 80)}[{j}]", kind_of(k, j))
        else:
            check(v, path, inert(k, 80), kind_of(k, None))
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

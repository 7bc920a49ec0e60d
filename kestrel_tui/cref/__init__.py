"""The compiled reference: the numerics contract in C (cref.h), loaded through ctypes.

`load()` returns the library built by `pip install` (setup.py builds it wherever a C
compiler is present; without one the install goes on and the numpy reference is used,
saying so once). `load(path)` loads another build of the same sources (tests, benchmarks).
"""
from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

P = ctypes.c_void_p
I64 = ctypes.c_int64
I32 = ctypes.c_int
F32 = ctypes.c_float

# name -> (restype, argtypes), as declared in cref.h; every pointer is passed as an address (P)
SIGNATURES = {
    "kc_expf1": (F32, [F32]),
    "kc_expf": (None, [P, P, I64]),
    "kc_cosf": (None, [P, P, I64]),
    "kc_sinf": (None, [P, P, I64]),
    "kc_sincosf": (None, [P, P, P, I64]),
    "kc_silu": (None, [P, P, I64]),
    "kc_f16_to_f32": (F32, [ctypes.c_uint16]),
    "kc_f32_to_f16": (ctypes.c_uint16, [F32]),
    "kc_quant_q8_0": (None, [P, I64, I64, P, P]),
    "kc_quant_rows_q8": (None, [P, I64, I64, P, P]),
    "kc_gemv_q4": (None, [P, I32, I64, P, P, P, I64, I32]),
    "kc_gemv_f32": (None, [P, I32, I64, P, P, I64, I32]),
    "kc_gemv_simd": (I32, [I32]),
    "kc_rmsnorm": (None, [P, P, I64, I64, F32, P]),
    "kc_qknorm": (None, [P, P, I64, I64, F32, P]),
    "kc_rope_cos_sin": (None, [P, I64, P, I64, P, P]),
    "kc_rope": (None, [P, I64, I64, I64, P, P, P]),
    "kc_attention": (None, [P, I64, I64, I64, I64, P, P, P, P, I32, P, F32, P, I32]),
    "kc_route": (None, [P, I64, I64, I64, I32, P, P]),
    "kc_combine": (None, [P, P, I64, I64, I64, P]),
    "kc_fnv_keys": (None, [P, P, P, I64, I64, P]),
    "kc_fnv_share": (None, [P, P, P, I64, I64, P, I64, I32, I32]),
    "kc_step": (I32, [P, P, I64, I64, P, P]),
    "kc_team_share_min": (None, [ctypes.c_double]),
}


class Job(ctypes.Structure):
    """kc_job: one matrix over some rows of x (cref.h)."""
    _fields_ = [("w", P), ("out", I64), ("n", I64), ("xrow", P), ("yrow", P), ("y_off", I64)]


class Unavailable(RuntimeError):
    """The compiled reference is not built here (the message says why, in one line)."""


def built_path() -> Path | None:
    """The library `pip install` built next to this file, if any."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_kcref{suffix}"
        if p.exists():
            return p
    return None


_LIBS: dict[str, ctypes.CDLL] = {}


def load(path: str | Path | None = None) -> ctypes.CDLL:
    """The compiled reference's library, its functions typed; raises Unavailable."""
    if path is None:
        path = built_path()
        if path is None:
            raise Unavailable("the compiled reference is not built (no C compiler at install time?):"
                              " reinstall with a C compiler present (pip install -e .)")
    key = str(path)
    if key not in _LIBS:
        try:
            lib = ctypes.CDLL(key)
        except OSError as e:
            raise Unavailable(f"the compiled reference at {key} does not load ({e}); reinstall (pip install -e .)")
        missing = [name for name in SIGNATURES if not hasattr(lib, name)]
        if missing:
            raise Unavailable(f"the compiled reference at {key} lacks {', '.join(missing[:3])}; reinstall"
                              " (pip install -e .)")
        for name, (res, args) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _LIBS[key] = lib
    return _LIBS[key]

"""Reading a `ggml_tensor *` from ggml's eval callback, through ctypes.

The struct mirrors `struct ggml_tensor` of ggml/include/ggml.h (the llama.cpp
that llama-cpp-python vendors): type, buffer, ne[4], nb[4], op, op_params,
flags, src[10], view_src, view_offs, data, name[64], extra, padding. The layout
is checked once against the library's own `ggml_tensor_overhead()` (the tensor
plus one 32-byte ggml_object), so a llama.cpp whose struct moved is refused
with one line instead of read as garbage.

A tensor is read as llama.cpp's debug callback (common/debug.cpp) reads it: a
host buffer in place, a device buffer through `ggml_backend_tensor_get`; then
viewed with its own strides (ne/nb, innermost first), so a non-contiguous view
(the top-k ids are a view of an argsort) reads right.
"""
from __future__ import annotations

import ctypes

import numpy as np

MAX_DIMS, MAX_SRC, MAX_OP_PARAMS, MAX_NAME = 4, 10, 64, 64
OBJECT_SIZE = 32  # sizeof(struct ggml_object): offs, size, next, type, padding[4]

GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I32 = 0, 1, 26
DTYPES = {GGML_TYPE_F32: np.dtype("<f4"), GGML_TYPE_F16: np.dtype("<f2"), GGML_TYPE_I32: np.dtype("<i4")}


class GGMLTensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * MAX_DIMS),
        ("nb", ctypes.c_size_t * MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class GGML:
    """The few ggml functions the reader needs, from the libggml llama-cpp-python ships."""

    def __init__(self, lib: ctypes.CDLL):
        def fn(name, res, *args):
            f = getattr(lib, name)
            f.restype, f.argtypes = res, list(args)
            return f

        self.op_name = fn("ggml_op_name", ctypes.c_char_p, ctypes.c_int)
        self.nbytes = fn("ggml_nbytes", ctypes.c_size_t, ctypes.c_void_p)
        self.overhead = fn("ggml_tensor_overhead", ctypes.c_size_t)
        self.is_host = fn("ggml_backend_buffer_is_host", ctypes.c_bool, ctypes.c_void_p)
        self.tensor_get = fn("ggml_backend_tensor_get", None, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_size_t)
        self._ops: dict[int, str] = {}

    def layout_problem(self) -> str | None:
        """Why this library's ggml_tensor is not the struct above (None: it is)."""
        want = int(self.overhead()) - OBJECT_SIZE
        have = ctypes.sizeof(GGMLTensor)
        if want != have:
            return f"its struct ggml_tensor is {want} bytes, this engine reads {have}"
        return None

    def op(self, code: int) -> str:
        name = self._ops.get(code)
        if name is None:
            name = self._ops[code] = (self.op_name(code) or b"?").decode()
        return name


def load_ggml() -> GGML:
    """libggml next to llama-cpp-python's libllama (llama_cpp._ggml loads it the same way)."""
    from llama_cpp import _ggml

    return GGML(_ggml.libggml)


def header(ptr: int) -> GGMLTensor:
    return GGMLTensor.from_address(ptr)


def tensor_name(t: GGMLTensor) -> str:
    return t.name.decode("utf-8", "replace")


def read(g: GGML, ptr: int, t: GGMLTensor | None = None) -> np.ndarray | None:
    """The tensor's values: f32 / f16 -> f32, i32 as it is, shape (ne3, ne2, ne1, ne0); None for
    another type (quantized cache rows: not a probe)."""
    t = t or header(ptr)
    dtype = DTYPES.get(t.type)
    if dtype is None or not t.data or not t.buffer:
        return None
    span = int(g.nbytes(ptr))  # first to last byte the strides touch
    if g.is_host(t.buffer):
        raw = (ctypes.c_char * span).from_address(t.data)
    else:
        raw = np.empty(span, np.uint8)
        g.tensor_get(ptr, raw.ctypes.data, 0, span)
    shape = tuple(int(n) for n in reversed(t.ne))
    strides = tuple(int(s) for s in reversed(t.nb))
    view = np.ndarray(shape, dtype, buffer=raw, strides=strides)
    # a copy in every case: host memory is llama.cpp's and is reused by the next node
    return view.astype(np.float32) if dtype.kind == "f" else np.array(view)

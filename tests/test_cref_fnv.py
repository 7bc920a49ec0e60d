"""The compiled reference's probe hashes (kestrel_tui/cref/fnv.c) against trace/fnv.py's fnv1a64 (the
fnv_c package), over the same bytes: kc_fnv_keys on buffers of many lengths (runs of equal lengths hash
eight chains at a time, so every run length mod 8 and every byte count mod 8 matters), split in shares
as the step's team splits it, and every key a compiled step returns against fnv1a64 of its raw buffer."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kestrel_tui.cref.backend import CompiledBackend
from kestrel_tui.trace.fnv import fnv1a64


def c_hashes(cref, bufs: list[np.ndarray], M: int, parts: int = 1) -> np.ndarray:
    """kc_fnv_keys / kc_fnv_share of keys whose columns are rows of bufs[j] ([M, bytes] uint8)."""
    n = len(bufs)
    base = (ctypes.c_void_p * n)(*[b.ctypes.data for b in bufs])
    nbytes = np.array([b.shape[1] for b in bufs], np.int64)
    out = np.zeros((M, n), np.uint64)
    if parts == 1:
        cref.kc_fnv_keys(base, nbytes.ctypes.data, nbytes.ctypes.data, n, M, out.ctypes.data)
    else:
        for part in range(parts):
            cref.kc_fnv_share(base, nbytes.ctypes.data, nbytes.ctypes.data, n, M, out.ctypes.data, n, part, parts)
    return out


@pytest.mark.parametrize("M", [1, 3, 16])
def test_fnv_keys_against_fnv1a64(cref, M):
    rng = np.random.default_rng(M)
    # runs of 1..19 keys of one length (lengths 0..2100, and the probe sizes 4, 8, 128, 256, 1024, 8192)
    lengths = []
    for n in list(rng.integers(0, 2100, 40)) + [4, 8, 128, 256, 1024, 8192, 0, 1, 7, 9]:
        lengths += [int(n)] * int(rng.integers(1, 20))
    bufs = [rng.integers(0, 256, (M, n), dtype=np.uint8) for n in lengths]
    want = np.array([[fnv1a64(b[m]) for b in bufs] for m in range(M)], np.uint64)
    for parts in (1, 2, 3, 7):
        got = c_hashes(cref, bufs, M, parts)
        bad = np.argwhere(got != want)
        assert not bad.size, f"{parts} parts: key {bad[0][1]} ({lengths[bad[0][1]]} bytes), column {bad[0][0]}"


def test_fnv_known_value(cref):
    """The FNV-1a 64 test vector the design names: fnv1a64(b"a") = 0xaf63dc4c8601ec8c."""
    a = np.frombuffer(b"a", np.uint8).reshape(1, 1).copy()
    assert int(c_hashes(cref, [a], 1)[0, 0]) == 0xAF63DC4C8601EC8C


@pytest.mark.parametrize("M", [1, 4])
def test_step_hashes_are_fnv1a64_of_its_buffers(small_model, cref, M):
    """Each hash a compiled step returns is fnv1a64 of the raw buffer it returns under the same key, for
    every key (the deep set included); prefill and decode."""
    b = CompiledBackend(small_model, deep=True, threads=2, lib_path=cref._name)
    b.reset(12)
    for tokens, pos0 in (([3, 1, 4, 1, 5][:M], 0), ([9], M)):
        out = b.step(np.array(tokens), pos0)
        for m in range(len(tokens)):
            assert list(out.hashes[m]) == list(out.raw[m])
            bad = [k for k, h in out.hashes[m].items() if h != fnv1a64(out.raw[m][k])]
            assert not bad, f"position {pos0 + m}: {len(bad)} keys, first {bad[0]}"

"""scripts/replica_exhaustive.py on small ranges: the edge regions of expf, cosf and sinf through its
chunk function bit for bit, its classes of difference, a planted difference reaching the exit
status and the JSON, and --merge adding two halves up to the whole."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

_path = Path(__file__).resolve().parents[1] / "scripts" / "replica_exhaustive.py"
_spec = importlib.util.spec_from_file_location("replica_exhaustive", _path)
rx = importlib.util.module_from_spec(_spec)
sys.modules["replica_exhaustive"] = rx
_spec.loader.exec_module(rx)

W = 2048  # bit patterns on either side of each edge

# float32 bit patterns where the replicas change behaviour (transcend.py), and their negatives
EDGES = {
    "zero and the smallest subnormals": 0x00000000,
    "subnormal/normal": 0x00800000,
    "FLT_MAX/inf/signalling NaN": 0x7F800000,
    "signalling/quiet NaN": 0x7FC00000,
    "the last NaNs": 0x7FFFFFFF - W + 1,
    "expf +inf threshold 88.7228394": 0x42B17218,
    "expf subnormal results (-87.34)": 0xC2AEAC50,
    "expf zero threshold -104": 0xC2D00000,
    "|x| = 2^-13": 0x39000000,
    "|x| = 2^-7": 0x3C000000,
    "|x| = pi/4": 0x3F490FDB,
    "Cody-Waite exact-product limit 6.5e6": 0x4AC65D40,
    "sinf Payne-Hanek 16779436": 0x4B800456,
    "cosf Payne-Hanek 3.37e9": 0x4F490FDB,
}


def edge_bits() -> np.ndarray:
    parts = []
    for b in EDGES.values():
        for s in (0, 0x80000000):
            lo = max(0, b - W)
            parts.append(rx.bit_patterns(s + lo, s + min(b + W, 0x80000000)))
    return np.unique(np.concatenate(parts))


@pytest.fixture(scope="module")
def c_evals(cref):
    return {fn: rx.c_replica(cref, fn) for fn in rx.FUNCTIONS}


def in_fallback(fn: str, bits: np.ndarray) -> np.ndarray:
    """cosf/sinf's Payne-Hanek range, inf and NaN: where numpy and C call their own libm."""
    if rx.HUGE[fn] is None:
        return np.zeros(bits.size, bool)
    return (bits & np.uint32(0x7FFFFFFF)) >= rx.HUGE[fn]


@pytest.mark.parametrize("fn", rx.FUNCTIONS)
def test_edges_equal_bit_for_bit(fn, c_evals):
    bits = edge_bits()
    tallies, want = rx.check_chunk(fn, bits, c_evals[fn])
    got = c_evals[fn](bits)
    inside = ~in_fallback(fn, bits)
    assert inside.sum() > 40_000
    assert np.array_equal(want[inside], got[inside]), \
        [hex(b) for b in bits[inside][want[inside] != got[inside]][:5]]
    assert tallies["differ"]["count"] == 0, tallies["differ"]["first"][:5]
    # the chunk's numpy bits are the replica's own, however the script slices them
    with np.errstate(invalid="ignore"):  # signalling NaNs among the inputs
        direct = getattr(rx.transcend, fn)(bits.view(np.float32)).view(np.uint32)
    assert np.array_equal(want, direct)


@pytest.mark.parametrize("fn", rx.FUNCTIONS)
def test_whole_exponent_ranges(fn, c_evals):
    """Two full binades (one around 1, one of large |x|) and a strided sample of every exponent."""
    bits = np.concatenate([rx.bit_patterns(0x3F800000, 0x3F800000 + (1 << 17)),
                           rx.bit_patterns(0xC6000000, 0xC6000000 + (1 << 17)),
                           rx.bit_patterns(0, 1 << 32, stride=65521)])
    tallies, _ = rx.check_chunk(fn, bits, c_evals[fn])
    assert tallies["differ"]["count"] == 0, tallies["differ"]["first"][:5]


def flip_one(c_eval, at_bits: int, mask: int = 1):
    """c_eval with one output bit flipped for one input: the difference the script must report."""
    def run(bits):
        out = c_eval(bits)
        out[bits == np.uint32(at_bits)] ^= np.uint32(mask)
        return out
    return run


def test_a_planted_difference_is_reported(c_evals):
    bits = rx.bit_patterns(0x3F800000, 0x3F801000)
    planted = 0x3F800ABC
    tallies, want = rx.check_chunk("expf", bits, flip_one(c_evals["expf"], planted))
    i = int(np.flatnonzero(bits == planted)[0])
    assert tallies["differ"] == {"count": 1, "first": [[planted, int(want[i]), int(want[i]) ^ 1]]}
    assert tallies["nan_payload"]["count"] == tallies["fallback"]["count"] == 0


def test_classes_follow_the_contract(c_evals):
    nan_in = 0x7FA00001  # a signalling NaN with a payload
    bits = np.array([nan_in, 0x3F000000], np.uint32)
    want = rx.numpy_replica("expf", bits)
    other_nan = want.copy()
    other_nan[0] = 0x7FC00000  # the canonical NaN: the payload lost
    assert want[0] == nan_in | 0x00400000  # T1: quieted, payload kept
    cpu = rx.classify("expf", bits, want, other_nan, nan_bits_promised=True)
    gpu = rx.classify("expf", bits, want, other_nan, nan_bits_promised=False)
    assert (cpu["differ"]["count"], cpu["nan_payload"]["count"]) == (1, 0)
    assert (gpu["differ"]["count"], gpu["nan_payload"]["count"]) == (0, 1)

    huge, inf = rx.HUGE["cosf"] + 5, 0xFF800000
    bits = np.array([huge, inf, 0x40000000], np.uint32)
    want = rx.numpy_replica("cosf", bits)
    assert np.isnan(want[1:2].view(np.float32)).all()
    t = rx.classify("cosf", bits, want, want ^ np.uint32(1), nan_bits_promised=True)
    # huge |x|: outside the replica; cos(-inf) NaN -> NaN: payload only; cos(2): the contract
    assert [t[c]["count"] for c in rx.CLASSES] == [1, 1, 1]
    not_nan = want.copy()
    not_nan[1] = 0x3F800000  # cos(-inf) = 1.0 breaks T2's "inf -> nan"
    t = rx.classify("cosf", bits, want, not_nan, nan_bits_promised=False)
    assert t["differ"] == {"count": 1, "first": [[inf, int(want[1]), 0x3F800000]]}


def test_main_exit_status_json_and_merge(cref, c_evals, tmp_path, monkeypatch, capsys):
    lo, mid, hi = 0x42B17218 - 3000, 0x42B17218, 0x42B17218 + 3000
    common = ["--functions", "expf", "--workers", "1", "--lib", cref._name]
    whole, a, b = (str(tmp_path / f) for f in ("whole.json", "a.json", "b.json"))
    assert rx.main(common + ["--start", hex(lo), "--stop", hex(hi), "--json", whole]) == 0
    assert rx.main(common + ["--start", hex(lo), "--stop", hex(mid), "--json", a]) == 0
    assert rx.main(common + ["--start", hex(mid), "--stop", hex(hi), "--json", b]) == 0
    merged = str(tmp_path / "merged.json")
    assert rx.main(["--merge", a, b, "--json", merged]) == 0
    w, m = (json.loads(Path(p).read_text())["functions"]["expf"] for p in (whole, merged))
    assert m["inputs"] == w["inputs"] == hi - lo
    assert m["ranges"] == [[lo, mid], [mid, hi]] and m["c"] == w["c"]

    capsys.readouterr()
    assert rx.main(["--merge", whole, a]) == 2  # overlapping ranges
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

    planted = mid - 7
    real = rx.c_replica
    monkeypatch.setattr(rx, "c_replica", lambda lib, fn, base=False: flip_one(real(lib, fn), planted, 1 << 30))
    bad = str(tmp_path / "bad.json")
    assert rx.main(common + ["--start", hex(lo), "--stop", hex(hi), "--json", bad]) == 1
    t = json.loads(Path(bad).read_text())["functions"]["expf"]["c"]["differ"]
    assert t["count"] == 1 and t["first"][0][0] == planted and t["first"][0][1] ^ t["first"][0][2] == 1 << 30

    # --c-base: the any-x86-64 build is a side of its own; a difference in it alone fails the run
    monkeypatch.setattr(rx, "c_replica", lambda lib, fn, base=False: (
        flip_one(real(lib, fn, base=True), planted, 1) if base else real(lib, fn)))
    assert rx.main(common + ["--start", hex(lo), "--stop", hex(hi), "--c-base", "--json", bad]) == 1
    doc = json.loads(Path(bad).read_text())
    rec = doc["functions"]["expf"]
    assert rec["c"]["differ"]["count"] == 0 and rec["c_base"]["differ"]["count"] == 1
    assert doc["c_build"] in ("AVX2 + FMA (KC_V3)", "any x86-64")


def test_bad_arguments_are_one_line(capsys):
    for argv in (["--functions", "tanf"], ["--start", "2**33"], ["--start", "5", "--stop", "5"]):
        with pytest.raises(SystemExit) as e:
            rx.main(argv)
        assert e.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_device_side_gets_the_numpy_bits(cref, c_evals):
    """The --cuda path without a GPU: a stand-in device (the C replica with one NaN made canonical
    and one bit flipped) is compared with the chunk's numpy bits under the GPU's NaN rule."""
    import argparse

    rx._init_worker(cref._name)
    lo = 0x7FBFF000
    args = argparse.Namespace(start=lo, stop=lo + 8192, stride=1, workers=1, c_base=False)

    def device(fn, bits):
        out = c_evals[fn](bits)
        out[bits == np.uint32(lo + 1)] = 0x7FFFFFFF  # a signalling NaN in, the canonical NaN out
        out[bits == np.uint32(lo + 2)] ^= np.uint32(1 << 30)  # a number where a NaN is due
        return out
    rec = rx.run_function("expf", args, None, device)
    assert rec["inputs"] == 8192 and rec["c"]["differ"]["count"] == 0
    assert rec["cuda"]["nan_payload"]["count"] == 1 and rec["cuda"]["nan_payload"]["first"][0][0] == lo + 1
    assert rec["cuda"]["differ"]["count"] == 1 and rec["cuda"]["differ"]["first"][0][0] == lo + 2

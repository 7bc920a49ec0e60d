"""A bundle's replay.py trusts nothing in its folder (docs/repro.md, "What replay.py checks").

Each test makes a bundle with `write_bundle`, copies it out of the repository as a maintainer would
receive it, damages the copy and runs its replay.py as a maintainer runs it: `python -I replay.py`
with a Python whose only package is numpy (so the replay provably imports nothing of kestrel-tui).
A damaged bundle must end in one line on stderr naming the file or field and the fix, exit 2 —
never a traceback (exit 1, which reads as "far"), a hang, a memory error, raw control codes on the
terminal, or a file read from outside the bundle.
"""
from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kestrel_tui.backends.toggles import TOGGLES
from kestrel_tui.session.repro import write_bundle
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.text import inert
from kestrel_tui.trace.compare import parse_tolerance
from replaytools import copy_away, numpy_only_python, run_replay

PROMPT = [5, 77, 190, 33]
T = len(PROMPT)


@pytest.fixture(scope="module")
def py(tmp_path_factory):
    return numpy_only_python(tmp_path_factory.mktemp("numpy-only"))


@pytest.fixture(scope="module")
def bundles(small_model, tmp_path_factory):
    """The sim with every op exact but norm (its nrm keys are far): bundles of an RMSNorm, a
    per-head norm and the q heads (GEMV, q_norm, RoPE)."""
    session = Session(small_model, PROMPT, 2, subject="sim", kv="q8")
    result = session.run(RunSettings(exact=frozenset(TOGGLES) - {"norm"}), record=False)
    root = tmp_path_factory.mktemp("bundles")
    tol = parse_tolerance("ulp=0")
    return {field: write_bundle(session, result, root / field, key=f"t{T}_l0_{field}", tol=tol).path
            for field in ("nrm", "knorm", "qrope")}


def _away(bundles, field: str, tmp_path: Path) -> Path:
    (tmp_path / "mail").mkdir(exist_ok=True)
    return copy_away(bundles[field], tmp_path / "mail")


def _edit_case(folder: Path, edit) -> None:
    p = folder / "case.json"
    case = json.loads(p.read_text())
    case = edit(case) or case
    p.write_text(json.dumps(case))


def _damaged(p, *words: str) -> str:
    """The replay refused in one line on stderr naming ``words``; returns that line."""
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and p.stderr.endswith("\n") and lines[0].startswith("replay.py: "), p.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert inert(lines[0], 10**6) == lines[0]  # no control character of the bundle's reaches the terminal
    return lines[0]


def _header(a: np.ndarray, shape=None, descr=None, fortran=False) -> bytes:
    """A .npy v1.0 header for ``a`` with its fields replaced."""
    d = {"descr": descr or np.lib.format.dtype_to_descr(a.dtype), "fortran_order": fortran,
         "shape": tuple(a.shape if shape is None else shape)}
    text = repr(d).encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def _data(path: Path) -> tuple[np.ndarray, bytes]:
    raw = path.read_bytes()
    f = io.BytesIO(raw)
    np.lib.format.read_magic(f)
    np.lib.format.read_array_header_1_0(f)
    return np.load(path), raw[f.tell():]


def test_the_genuine_bundle_replays_with_numpy_only(bundles, py, tmp_path):
    p = run_replay(py, _away(bundles, "nrm", tmp_path))
    assert p.returncode == 1 and p.stderr == "" and p.stdout.splitlines()[-1].startswith("verdict: far"), p


# ---------------------------------------------------------------- the reproductions as filed

def test_case_json_that_is_a_list(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    (copy / "case.json").write_text("[]")
    _damaged(run_replay(py, copy), "case.json", "object")


def test_an_op_that_is_a_number(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    _edit_case(copy, lambda c: c.update(op=5))
    _damaged(run_replay(py, copy), "case.json", "op")


@pytest.mark.parametrize("field, name, value", [("nrm", "eps", "1e-06"), ("knorm", "n_kv_heads", "2")])
def test_a_constant_given_as_a_string(bundles, py, tmp_path, field, name, value):
    copy = _away(bundles, field, tmp_path)
    _edit_case(copy, lambda c: c["const"].update({name: value}))
    _damaged(run_replay(py, copy), "case.json", f"const.{name}")


def test_weights_given_as_a_list(bundles, py, tmp_path):
    copy = _away(bundles, "qrope", tmp_path)
    _edit_case(copy, lambda c: c.update(weights=list(c["weights"].values())))
    _damaged(run_replay(py, copy), "case.json", "weights")


def test_a_criterion_given_as_a_string(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    _edit_case(copy, lambda c: c["tolerance"]["criteria"].update(ulp="0"))
    _damaged(run_replay(py, copy), "case.json", "tolerance.criteria.ulp")


def test_an_npy_header_declaring_two_to_the_forty_elements(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    path = copy / "weights" / "norm.npy"
    a, data = _data(path)
    path.write_bytes(_header(a, shape=(2**40,)) + data)
    _damaged(run_replay(py, copy), "weights/norm.npy", "[1099511627776]")


def test_an_empty_npy(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    (copy / "inputs" / "reference" / "x.npy").write_bytes(b"")
    _damaged(run_replay(py, copy), "inputs/reference/x.npy", "empty")


def test_a_weight_replaced_by_a_fifo(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    path = copy / "weights" / "norm.npy"
    path.unlink()
    os.mkfifo(path)
    _damaged(run_replay(py, copy, timeout=15), "weights/norm.npy", "FIFO")


def test_a_key_holding_escape_sequences_is_printed_inert(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    key = "t4_l0_nrm\x1b[2J\x1b]0;owned\x07\u202e\x9b31m"
    _edit_case(copy, lambda c: c.update(key=key, inputs_note="a\nb\rc"))
    p = run_replay(py, copy)
    assert p.returncode == 1 and p.stderr == "", p
    assert inert(p.stdout.replace("\n", ""), 10**6) == p.stdout.replace("\n", ""), repr(p.stdout)
    assert p.stdout.startswith("t4_l0_nrm\\x1b[2J\\x1b]0;owned\\x07\\u202e\\x9b31m: ")
    assert "note: a\\nb\\rc\n" in p.stdout


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_a_weight_outside_the_bundle_is_not_read(bundles, py, tmp_path, where):
    """The genuine q_norm copied outside the bundle and pointed at: the old replay read it and gave its
    verdict."""
    copy = _away(bundles, "qrope", tmp_path)
    outside = tmp_path / "mail" / "x.npy"
    outside.write_bytes((copy / "weights" / "q_norm.npy").read_bytes())
    if where == "symlink":
        (copy / "weights" / "q_norm.npy").unlink()
        (copy / "weights" / "q_norm.npy").symlink_to(outside)
        _damaged(run_replay(py, copy), "weights/q_norm.npy", "symbolic link")
        return
    name = str(outside) if where == "absolute" else "../x.npy"
    _edit_case(copy, lambda c: c["weights"].update(q_norm=name))
    _damaged(run_replay(py, copy), "case.json", "weights.q_norm", "inside the bundle")


# ---------------------------------------------------------------- more damage, one line each

def test_a_symlinked_folder_is_not_followed(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    os.rename(copy / "weights", tmp_path / "weights-elsewhere")
    (copy / "weights").symlink_to(tmp_path / "weights-elsewhere")
    _damaged(run_replay(py, copy), "weights", "symbolic link")


def test_a_directory_where_an_array_belongs(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    (copy / "outputs" / "subject.npy").unlink()
    (copy / "outputs" / "subject.npy").mkdir()
    _damaged(run_replay(py, copy), "outputs/subject.npy", "directory")


@pytest.mark.parametrize("damage, words", [
    ("truncated", ("truncated",)), ("trailing", ("more than its header",)), ("dtype", ("<f8",)),
    ("fortran", ("Fortran",)), ("shape", ("[16, 16]",)), ("magic", ("not a .npy",)), ("missing", ("missing",))])
def test_a_damaged_array(bundles, py, tmp_path, damage, words):
    copy = _away(bundles, "nrm", tmp_path)
    path = copy / "outputs" / "reference.npy"
    a, data = _data(path)
    new = {"truncated": lambda: _header(a) + data[:-3], "trailing": lambda: _header(a) + data + b"\0" * 8,
           "dtype": lambda: _header(a, descr="<f8") + data * 2, "fortran": lambda: _header(a, fortran=True) + data,
           "shape": lambda: _header(a, shape=(16, 16)) + data, "magic": lambda: b"PK\x03\x04" + data,
           "missing": lambda: None}[damage]()
    if new is None:
        path.unlink()
    else:
        path.write_bytes(new)
    _damaged(run_replay(py, copy), "outputs/reference.npy", *words)


def test_an_array_that_does_not_fit_its_op(bundles, py, tmp_path):
    """Header and case.json agree, but the norm weight is one element short of the input."""
    copy = _away(bundles, "nrm", tmp_path)
    path = copy / "weights" / "norm.npy"
    a, data = _data(path)
    path.write_bytes(_header(a, shape=(a.size - 1,)) + data[:-4])
    _edit_case(copy, lambda c: c["arrays"]["weights/norm.npy"].update(shape=[a.size - 1]))
    _damaged(run_replay(py, copy), "weights/norm.npy", "rmsnorm", f"[{a.size}]")


def test_a_bundle_without_declared_shapes(bundles, py, tmp_path):
    """A format-1 bundle (no shapes in case.json) refused by this replay.py, pointing at its own."""
    copy = _away(bundles, "nrm", tmp_path)
    _edit_case(copy, lambda c: (c.pop("arrays"), c.update(bundle=1)) and None)
    _damaged(run_replay(py, copy), "case.json", "format 1")


def test_a_huge_case_json_is_not_read(bundles, py, tmp_path):
    copy = _away(bundles, "nrm", tmp_path)
    with open(copy / "case.json", "r+b") as f:
        f.truncate(2**40)  # sparse: a terabyte that takes no disk
    _damaged(run_replay(py, copy), "case.json", "MB")


def test_the_replay_names_another_folder(bundles, py, tmp_path):
    """`python replay.py FOLDER`: a maintainer's own copy of replay.py on a bundle it did not come with."""
    import subprocess

    copy = _away(bundles, "nrm", tmp_path)
    p = subprocess.run([py, "-I", str(copy / "replay.py"), str(copy)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and p.stdout.splitlines()[-1].startswith("verdict: far"), p
    p = subprocess.run([py, "-I", str(copy / "replay.py"), str(tmp_path / "nowhere")], capture_output=True,
                       text=True, timeout=60)
    _damaged(p, "nowhere")


def test_the_replay_makes_text_inert_as_kestrel_tui_does():
    """replay.py carries its own copy of text.inert (it imports nothing of ours): the same on every kind
    of character."""
    import importlib.util

    from kestrel_tui.session import repro

    spec = importlib.util.spec_from_file_location("replay_inert", repro.TEMPLATE)
    R = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(R)
    samples = ["plain", "\x1b[2J\x1b]0;t\x07", "a\nb\rc\td", "\x9b31m\x85", "\u202e\u2028\u2029\ufeff", "\ud800",
               "\ue000\U0010fffd", "\U000e0001", "é漢字🙂", "x" * 400, "\x1b" * 301, ""]
    for s in samples:
        for limit in (300, 10, 0):
            assert R.inert(s, limit) == inert(s, limit), (s, limit)
    assert set(R.KINDS) == set(R.OPS)

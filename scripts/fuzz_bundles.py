"""Fuzz a repro bundle's replay.py with damaged bundles; results/fuzz-bundles.md records a run.

    .venv/bin/python scripts/fuzz_bundles.py --cases 100000 --seed 20261205 --workers 2

(about 5 minutes on a quiet 2-core VM; `--case JSON` runs one case, as a failure prints it.)

Seeds: real bundles written once by `kestrel-tui repro` on the embedded model (the sim with every op
exact but norm), one of every kind of op replay.py knows: the RMSNorms (far), the embedding row, the
K GEMV, K norm, RoPE and cache row, the V row's scale, the q heads, attention over the q8 and the f32
cache, o_proj plus the residual, a MoE layer's FFN, the router's top-k, the residual add, the chosen
experts in f32, the logits. Each case is one bundle copied and damaged by one or two mutations (never
two at one file or field), drawn by the hypothesis strategies below:

* case.json: a field (anywhere: read by the replay or not) set to another type, a huge, negative,
  non-finite or thousands-of-digits number, a deep nesting, a long string, escape sequences; a field
  removed or an unknown one added; a path field pointed outside the bundle (absolute, `..`, a
  Windows device name, a NUL byte, a directory, case.json itself) or at another array of the bundle;
  a printed field (key, op name, tolerance, note) given control characters; the text truncated,
  bytes flipped, a BOM, not UTF-8, padded past the 8 MB bound, replaced by `[]`, `null`, ...;
* the .npy files: empty, truncated, bytes appended, the header's shape (2^40, 0, one more, another
  rank), dtype (<f8, >f4, object, unicode, void, structured) or Fortran flag changed, the header
  garbled (not a dict, missing keys, 5000 digits, Python 2 longs, deep nesting), its version or
  length field changed, the magic broken; or re-encoded harmlessly (version 2.0, other key order or
  padding); a shape or dtype changed consistently in the header and case.json (a huge shape beyond
  the bound, sometimes as a sparse file that big);
* the files themselves: an array, case.json or a folder swapped for a FIFO, a directory, a symbolic
  link (to a genuine copy outside or inside, dangling, a loop, /dev/zero) or removed.

Each case runs replay.py's ``main([folder])`` in-process, in worker processes under RLIMIT_AS 3 GB
that take many cases each, with SIGALRM at 5 s (and the worker killed if it does not answer at 10 s).
Every case must end in exit 0/1 or 2 within 5 s with no traceback and no warning; stdout and stderr
hold no control character; exit 2 is exactly one stderr line "replay.py: <the bundle's file>: ...";
exit 0/1 has an empty stderr and a last line whose verdict matches the status. Each mutation knows
what it does: one that damages the bundle must give exit 2 ("accepted" otherwise), one that leaves
every array and what the replay reads intact must give the genuine status and the genuine counts
("refused" or "changed" otherwise), one that makes another well-formed bundle (another array of the
right shape, other criteria) may give any. The exit status is 1 on any violation.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import platform
import random
import re
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unicodedata
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

AS_LIMIT = 3 << 30
CASE_SECONDS = 5.0
KILL_SECONDS = 10.0
FAILURES = ("harness", "traceback", "hang", "died", "slow", "status", "multiline", "unnamed", "raw", "warning",
            "accepted", "refused", "changed", "verdict")
REPRO = ["--exact", "all", "--toggle", "norm=fast", "--tokens", "1", "--no-cache"]
DEEP, F32 = ["--deep"], ["--weights", "f32", "--kv", "f32"]
SEEDS = {  # name -> (key, extra options): every kind of op replay.py knows, q4_0/q8 and f32
    "nrm": ("t16_l0_nrm", []), "emb": ("t16_emb", []), "kraw": ("t16_l0_kraw", []),
    "knorm": ("t16_l0_knorm", []), "k": ("t16_l0_k", []), "vs": ("t16_l0_vs", []),
    "qrope": ("t16_l0_qrope", []), "attn": ("t16_l0_attn", []), "ores": ("t16_l0_ores", []),
    "ffn": ("t16_l0_x", []), "logits": ("t16_logits", []), "kpre": ("t16_l0_kpre", DEEP),
    "topk": ("t16_l0_topk", DEEP), "add": ("t16_l0_x", DEEP), "moe32": ("t16_l0_moe", DEEP + F32),
    "attn32": ("t16_l1_attn", F32),
}
# what replay.py reads of case.json (the rest describes the case to people)
READ = [["bundle"], ["key"], ["op"], ["tolerance", "spec"], ["tolerance", "criteria"], ["reference_is_contract"],
        ["inputs_note"], ["const"], ["inputs"], ["weights"], ["outputs"], ["arrays"]]
PRINTED = (("key",), ("op", "name"), ("op", "rules"), ("tolerance", "spec"), ("inputs_note",))

# ---------------------------------------------------------------- seeds


def make_seeds(root: Path) -> dict[str, Path]:
    """The genuine bundles, by `kestrel-tui repro` (in-process) on the embedded model."""
    from kestrel_tui.cli import main as cli_main

    seeds = {}
    for name, (key, extra) in SEEDS.items():
        out = root / name
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli_main(["repro", str(out), *REPRO, *extra, "--key", key])
        if code != 0:
            raise RuntimeError(f"kestrel-tui repro {key} exited {code}")
        seeds[name] = out
    return seeds


def load_replay(path: Path):
    spec = importlib.util.spec_from_file_location("fuzzed_replay", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _paths(doc, prefix=()) -> list[tuple]:
    """Every path into case.json (long lists: their first and last items only)."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i in sorted({0, len(doc) - 1}) if doc else ():
            out += _paths(doc[i], prefix + (i,))
    return out


def seed_info(seeds: dict[str, Path]) -> dict:
    """What the strategies draw from, per seed: its case.json paths, arrays and their roles."""
    info = {}
    for name, folder in seeds.items():
        case = json.loads((folder / "case.json").read_text())
        roles = {p: "output" for p in case["outputs"].values()}
        roles.update({p: "weight" for p in case["weights"].values()})
        roles.update({p: "input" for side in case["inputs"].values() for p in side.values()})
        path_fields = [("outputs", s) for s in case["outputs"]] + [("weights", n) for n in case["weights"]]
        path_fields += [("inputs", s, n) for s in case["inputs"] for n in case["inputs"][s]]
        paths = _paths(case)
        info[name] = {"paths": [list(p) for p in paths],
                      "field_files": {json.dumps(list(f)): _at(case, f) for f in path_fields},
                      "dicts": [list(p) for p in [()] + paths if isinstance(_at(case, p), dict)],
                      "npy": sorted(roles), "roles": roles, "path_fields": [list(p) for p in path_fields],
                      "dirs": sorted({p.rsplit("/", 1)[0] for p in roles})}
    return info


def _at(doc, path):
    for k in path:
        doc = doc[k]
    return doc


# ---------------------------------------------------------------- strategies (descriptions of cases)


def strategies(info: dict):
    """The hypothesis strategy of one case: {"seed": name, "muts": [mutation, ...]}, plain JSON."""
    from hypothesis import strategies as st

    escape = st.lists(st.one_of(st.sampled_from(
        ["\x1b[2J", "\x1b]0;owned\x07", "\x9b31m", "\u202e", "\n", "\r\n", "\t", "\x00", "\x7f", "\u2028", "\ud800",
         "\udfff", "[red]", "%s", "{x}", "é", "🙂", "\ufeff", "\x1b[?1049h", "\U000e0001"]), st.text(max_size=6)),
        max_size=6).map("".join)
    raw = st.fixed_dictionaries({"raw": st.sampled_from(
        ["digits", "negdigits", "deep_list", "deep_dict", "long_string", "nan", "inf", "-inf", "big_list",
         "float_digits"]), "n": st.sampled_from([30, 310, 4301, 5000, 20000])})
    value = st.one_of(
        st.sampled_from([0, 1, -1, 2, 8, 256, 2**31, 2**32, 2**53 + 1, 2**63, 2**64, -(2**63), 10**30, 0.5, -0.0, 1e308,
                         -1e-300, 1e-45, 3.4e38, 3.5e38, True, False, None, "", "0", "1e-06", "q8", "f32", "knorm",
                         "rmsnorm", "gemv", "attention", "<f4", "|u1", [], {}, [1], {"a": 1}, [256], [2, 64],
                         "weights/norm.npy", "inputs/reference/x.npy", "ulp=0"]),
        st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12), raw,
        escape)
    names = st.sampled_from(["extra", "x", "\x1b[2J", "bias", "q_bias", "v_bias", "o_bias", "reference", "top_k",
                             "dtype", "weights/extra.npy", "h", "topk", "fortran"])
    hostile_paths = st.sampled_from(
        ["@abs", "../outside.npy", "weights/../../outside.npy", "inputs/reference/../../outside.npy", "./@real",
         "@dir/./@base", "@dir//@base", "@dir\\@base", "", ".", "..", "/", "case.json", "replay.py", "README.md",
         "@dir", "NUL.npy", "con.npy", "COM1.npy", "@real\x00", "@real ", "@REAL", "/dev/zero", "/proc/self/fd/0",
         "~/x.npy", "C:\\x.npy", "\\\\server\\share\\x.npy", "@dir/" + "a" * 300 + ".npy", "@dir/.@base",
         "a/b/c/d/e.npy", "@dir/nοrm.npy"])

    def for_seed(name: str):
        si = info[name]
        npy = st.sampled_from(si["npy"])
        case_set = st.fixed_dictionaries({"family": st.just("case"), "op": st.just("set"),
                                          "path": st.sampled_from(si["paths"]), "value": value})
        case_drop = st.fixed_dictionaries({"family": st.just("case"), "op": st.just("drop"),
                                           "path": st.sampled_from(si["paths"])})
        case_add = st.fixed_dictionaries({"family": st.just("case"), "op": st.just("add"),
                                          "path": st.sampled_from(si["dicts"]), "name": names, "value": value})
        text = st.fixed_dictionaries({"family": st.just("text"), "op": st.sampled_from(
            ["truncate", "flip", "insert", "replace", "bom", "pad", "huge", "latin1", "spaces"]),
            "at": st.floats(0, 1), "bytes": st.binary(min_size=1, max_size=8).map(bytes.hex),
            "doc": st.sampled_from(["", "[]", "{}", "null", '"x"', "1e999", "@open", "@deep", "\ufeff{}",
                                    "{\"bundle\": 2}"])})
        long = st.builds(lambda c, n: c * n, st.sampled_from(["x", "\x1b", "é", "\u202e", "🙂"]),
                         st.integers(300, 3000))
        printed = st.fixed_dictionaries({"family": st.just("print"), "text": st.one_of(escape, long),
                                         "path": st.sampled_from([list(p) for p in PRINTED])})
        path = st.fixed_dictionaries({"family": st.just("path"), "field": st.sampled_from(si["path_fields"]),
                                      "to": st.one_of(hostile_paths, npy), "declare": st.booleans()})
        arrays = st.fixed_dictionaries({"family": st.just("arrays"), "file": npy, "what": st.sampled_from(
            ["shape", "dtype", "drop", "entry"]), "value": st.one_of(value, st.sampled_from(
                [[2**40], [-1], [], [0], [1] * 9, [256.0], ["256"], [2**41], "<f8", ">f4", "|O", "<U4", "|V4",
                 "float32", "<f4 "]))})
        # "pick": the variant a mutation takes (its random generator is seeded by the whole description)
        header = st.fixed_dictionaries({"family": st.just("npy"), "file": npy, "op": st.sampled_from(
            ["shape", "descr", "fortran", "garble", "version", "hlen", "magic"]), "pick": st.integers(0, 99)})
        reencode = st.fixed_dictionaries({"family": st.just("npy"), "file": npy, "op": st.just("reencode"),
                                          "pick": st.integers(0, 99)})
        cut = st.fixed_dictionaries({"family": st.just("npy"), "file": npy, "op": st.sampled_from(
            ["empty", "truncate", "append"]), "at": st.floats(0, 1),
            "bytes": st.binary(min_size=1, max_size=64).map(bytes.hex)})
        consistent = st.fixed_dictionaries({"family": st.just("npy"), "file": npy, "op": st.sampled_from(
            ["resize", "retype", "huge"]), "pick": st.integers(0, 99), "sparse": st.booleans()})
        swap = st.fixed_dictionaries({"family": st.just("file"), "file": st.sampled_from(
            si["npy"] + ["case.json"] + si["dirs"]), "to": st.sampled_from(
            ["fifo", "dir", "link_out", "link_in", "dangling", "loop", "devzero", "missing"])})
        one = st.one_of(case_set, case_set, case_set, case_drop, case_add, text, printed, path, arrays,
                        header, header, reencode, cut, consistent, swap)
        def target(m: dict) -> str:
            """The file (its data, declaration or the field naming it) or case.json field a mutation aims at."""
            if "file" in m:
                return m["file"]
            path = m.get("path") or m.get("field") or []
            if path[:1] == ["arrays"] and len(path) > 1:
                return path[1]
            file = si["field_files"].get(json.dumps(path))
            return file or "case.json " + ("text" if m["family"] == "text" else json.dumps(path[:2]))

        # two mutations never aim at one file or field: the second could undo the first
        return st.fixed_dictionaries({"seed": st.just(name), "muts": st.lists(one, min_size=1, max_size=2,
                                                                             unique_by=target)})

    return st.one_of([for_seed(name) for name in sorted(info)])


def draw_cases(info: dict, n: int, seed: int) -> list[dict]:
    """n case descriptions, the same for the same seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out: list[dict] = []

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategies(info))
    def collect(case):
        if len(out) < n:
            out.append(case)

    collect()
    i = 0
    while len(out) < n:  # hypothesis may stop short of max_examples: pad by cycling
        out.append(out[i])
        i += 1
    return out


# ---------------------------------------------------------------- applying a case (in the worker)


def _raw_text(v) -> str:
    """JSON text of a strategy value ({"raw": ...} values are written as text json.dumps cannot write)."""
    if isinstance(v, dict) and set(v) == {"raw", "n"}:
        k, n = v["raw"], v["n"]
        return {"digits": "9" * n, "negdigits": "-" + "9" * n, "deep_list": "[" * n + "]" * n,
                "deep_dict": '{"a":' * n + "1" + "}" * n, "long_string": '"' + "x" * (n * 10) + '"', "nan": "NaN",
                "inf": "Infinity", "-inf": "-Infinity", "big_list": "[" + ",".join(["0"] * n) + "]",
                "float_digits": "1" + "0" * n + ".5"}[k]
    return json.dumps(v)


def _category(v) -> str:
    if isinstance(v, dict) and set(v) == {"raw", "n"}:
        return {"deep_list": "list", "big_list": "list", "deep_dict": "dict", "long_string": "str"}.get(v["raw"], "num")
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    return {int: "num", float: "num", str: "str", list: "list", dict: "dict"}[type(v)]


MARK = "\x00fuzz-value\x00"


def _dump(case) -> str:
    """case.json's text with any {"raw": ...} value written raw."""
    raws: list[str] = []

    def sub(v):
        if isinstance(v, dict) and set(v) == {"raw", "n"}:
            raws.append(_raw_text(v))
            return f"{MARK}{len(raws) - 1}"
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [sub(x) for x in v]
        return v

    text = json.dumps(sub(case), indent=1)
    return re.sub(r'"\\u0000fuzz-value\\u0000(\d+)"', lambda m: raws[int(m.group(1))], text)


def _same(a, b) -> bool:
    """Equal as JSON writes them (256.0 is not 256, true is not 1)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _parses(v) -> bool:
    """Whether json reads the value's text (not 5000 digits, not nested 5000 deep)."""
    try:
        json.loads(_raw_text(v))
        return True
    except (ValueError, RecursionError):
        return False


def _is_read(path: list) -> bool:
    """Whether replay.py reads the field at path (or a field inside it)."""
    return bool(path) and any(r[:len(path)] == path or path[:len(r)] == r for r in READ)


def _expect_set(path: list, old, new) -> str:
    """What setting case.json's field at path from old to new must give: same, refuse or any."""
    if not _parses(new):
        return "refuse"
    if not _is_read(path):
        return "same"
    if _same(new, old):
        return "same"
    if tuple(path) in PRINTED:
        return "same" if _category(new) == "str" else "refuse"
    if path[0] in ("bundle", "arrays"):
        return "refuse"
    if path[0] in ("inputs", "weights", "outputs"):
        return "refuse" if _category(new) != "str" or len(path) < (3 if path[0] == "inputs" else 2) else "any"
    cat_old, cat_new = _category(old), _category(new)
    if cat_new != cat_old and "null" not in (cat_old, cat_new):
        return "refuse"
    return "any"


def _apply_case(case: dict, m: dict, folder: Path, original: dict) -> str:
    path = m["path"]
    try:
        parent = _at(case, path[:-1]) if path else None
    except (KeyError, IndexError, TypeError):
        return "same"  # a field an earlier mutation removed
    if m["op"] == "add":
        try:
            target = _at(case, path)
        except (KeyError, IndexError, TypeError):
            return "same"
        if not isinstance(target, dict) or m["name"] in target:
            return "same"
        target[m["name"]] = m["value"]
        if not _parses(m["value"]):
            return "refuse"
        if not path:
            return "same"
        if path[0] in ("inputs", "weights", "outputs") or path == ["arrays"]:
            return "refuse"
        return "same"
    if not path or not isinstance(parent, (dict, list)):
        return "same"
    key = path[-1]
    if isinstance(parent, dict) and key not in parent or isinstance(parent, list) and not (
            isinstance(key, int) and key < len(parent)):
        return "same"
    old = parent[key]
    if m["op"] == "drop":
        del parent[key]
        optional = path == ["const", "top_k"] and original["op"]["kind"] == "experts"
        return "refuse" if _is_read(path) and not optional else "same"
    parent[key] = m["value"]
    if len(path) >= 3 and path[0] == "arrays" and path[2] not in ("dtype", "shape"):
        return "same"
    return _expect_set(path, old, m["value"])


def _apply_text(text: str, m: dict) -> tuple[bytes, str]:
    """case.json's bytes after a text mutation, and what it must give."""
    b = text.encode()
    at = int(m["at"] * len(b))
    op = m["op"]
    if op == "truncate":
        new = b[:min(at, len(b) - 1)]
    elif op == "flip":
        new = bytearray(b)
        for i, x in enumerate(bytes.fromhex(m["bytes"])):
            j = (at + 7919 * i) % len(b)
            new[j] ^= x or 1
        new = bytes(new)
    elif op == "insert":
        new = b[:at] + bytes.fromhex(m["bytes"]) + b[at:]
    elif op == "replace":
        doc = {"@open": "[" * 100000, "@deep": '{"a":' * 5000 + "1" + "}" * 5000}.get(m["doc"], m["doc"])
        new = doc.encode("utf-8", "surrogatepass")
    elif op == "bom":
        new = b"\xef\xbb\xbf" + b
    elif op == "pad":
        new = b + b" " * 1000
    elif op == "huge":
        new = b + b" " * (8 << 20)
    elif op == "latin1":
        new = text.replace('"', '"\xe9', 1).encode("latin1", "replace")
    else:  # spaces: the same document laid out otherwise (where it is one json reads)
        try:
            new = json.dumps(json.loads(text), indent=None, separators=(" ,", " : ")).encode()
        except (ValueError, RecursionError):
            new = b + b"\n\t \r\n"
    if len(new) > 8 << 20:
        return new, "refuse"
    try:
        parsed = json.loads(new.decode("utf-8"))
    except (ValueError, RecursionError):
        return new, "refuse"
    try:
        return new, "same" if parsed == json.loads(text) else "any"
    except (ValueError, RecursionError):
        return new, "any"


def _npy_parts(raw: bytes) -> tuple[dict, bytes]:
    import numpy as np

    f = io.BytesIO(raw)
    np.lib.format.read_magic(f)
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    return {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": shape}, raw[f.tell():]


def _header(text: str, version=(1, 0), pad=0) -> bytes:
    """A .npy header holding ``text`` as numpy writes one (padded to 64 bytes, and ``pad`` more)."""
    body = text.encode("latin1", "replace")
    lenfmt = "<H" if version[0] == 1 else "<I"
    body += b" " * ((-(8 + struct.calcsize(lenfmt) + len(body) + 1) % 64) + pad) + b"\n"
    return b"\x93NUMPY" + bytes(version) + struct.pack(lenfmt, len(body)) + body


def _dict_text(d: dict, order=("descr", "fortran_order", "shape"), spaced=False) -> str:
    sep = " ,  " if spaced else ", "
    return "{" + sep.join(f"{k!r}: {d[k]!r}" for k in order) + (" , }" if spaced else ", }")


def _apply_npy(folder: Path, m: dict, case: dict, roles: dict, rng: random.Random) -> str:
    rel = m["file"]
    p = folder / rel
    if not _is_regular(p) or p.stat().st_size > 1 << 26:
        return "same"  # swapped, or made a sparse giant, already
    raw = p.read_bytes()
    try:
        d, data = _npy_parts(raw)
    except ValueError:  # an earlier mutation of the same file
        return "same"
    op = m["op"]
    if op == "empty":
        p.write_bytes(b"")
        return "refuse"
    if op == "truncate":
        p.write_bytes(raw[:min(int(m["at"] * len(raw)), len(raw) - 1)])
        return "refuse"
    if op == "append":
        p.write_bytes(raw + bytes.fromhex(m["bytes"]))
        return "refuse"
    n = math.prod(d["shape"])
    if op == "reencode":
        how = rng.choice(["v2", "order", "spaced", "pad"])
        text = _dict_text(d, ("shape", "descr", "fortran_order") if how == "order" else
                          ("descr", "fortran_order", "shape"), spaced=how == "spaced")
        p.write_bytes(_header(text, (2, 0) if how == "v2" else (1, 0), pad=64 if how == "pad" else 0) + data)
        return "same"
    if op in ("shape", "descr", "fortran"):
        new = dict(d)
        if op == "shape":
            new["shape"] = rng.choice([(2**40,), (2**62,), (0,), (n + 1,), (max(n - 1, 0),), d["shape"] + (1,),
                                       (1,) + d["shape"], tuple(reversed(d["shape"])), (-1,), (2**31, 2**31)])
        elif op == "descr":
            new["descr"] = rng.choice(["<f8", ">f4", "|O", "<U4", "|V4", "<i4", "|b1", "<f2", "<c8", "<f4", "|u1",
                                       "<i8", [("a", "<f4")]])
        else:
            new["fortran_order"] = True
        if new == d:
            return "same"
        p.write_bytes(_header(_dict_text(new)) + data)
        return "refuse"
    if op == "garble":
        text = rng.choice([
            "{}", "{'descr': '<f4'}", "[1, 2]",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "9" * 5000 + ",), }",
            "(" * 3000, _dict_text(d)[:-2] + ", 'extra': 1, }", "{'descr': '<f4', 'fortran_order': 0, 'shape': (256,)}",
            _dict_text({**d, "shape": list(d["shape"])}),
            _dict_text({**d, "shape": tuple(float(x) for x in d["shape"])}),
            _dict_text(d).replace(f"{d['shape'][0]},", f"{d['shape'][0]}L,"), "__import__('os').system('true')",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (" + "(" * 200 + ")" * 200 + ",)}", "\udcff" * 10])
        p.write_bytes(_header(text) + data)
        return "refuse"
    if op == "version":
        v = rng.choice([(3, 0), (1, 1), (0, 0), (255, 255), (2, 0)])
        head = _header(_dict_text(d))
        p.write_bytes(head[:6] + bytes(v) + head[8:] + data)  # a v1 length field under another version
        return "refuse"
    if op == "hlen":
        head = _header(_dict_text(d))
        real = struct.unpack("<H", head[8:10])[0]
        n_new = rng.choice([0, 1, real - 1, real + 1, real + 64, 65535, 10001])
        p.write_bytes(head[:8] + struct.pack("<H", n_new) + head[10:] + data)
        return "refuse"
    if op == "magic":
        i = rng.randrange(6)
        b = bytearray(raw)
        b[i] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(b))
        return "refuse"
    arrays = case.get("arrays")
    decl = arrays.get(rel) if isinstance(arrays, dict) else None
    if not isinstance(decl, dict):
        return "same"
    role = roles[rel]
    if op == "resize":  # the same elements in another shape, header and case.json agreeing
        shapes = [(n,), (1, n), (n, 1)] + ([(d["shape"][0] * d["shape"][1],) + d["shape"][2:]] if len(d["shape"]) > 1
                                           else [])
        new_shape = rng.choice([s for s in shapes if s != d["shape"]] or [(1,) + d["shape"]])
        p.write_bytes(_header(_dict_text({**d, "shape": new_shape})) + data)
        decl["shape"] = list(new_shape)
        return "refuse" if role == "weight" else "same"
    if op == "retype":  # another dtype of the same size
        import numpy as np

        same_size = {1: ["|i1", "|u1"], 4: ["<f4", "<i4", "<u4"], 8: ["<i8", "<u8", "<f8"]}
        size = np.dtype(d["descr"]).itemsize
        new = rng.choice([t for t in same_size[size] if t != d["descr"]])
        p.write_bytes(_header(_dict_text({**d, "descr": new})) + data)
        decl["dtype"] = new
        return "any" if role == "output" else "refuse"
    # huge: a shape beyond the bound in both, maybe as a sparse file of that size
    new_shape = rng.choice([(2**40,), (2**33,), (2**31, 4), (2**20, 2**20)])
    head = _header(_dict_text({**d, "shape": new_shape}))
    p.write_bytes(head + data)
    if m["sparse"]:
        with open(p, "r+b") as f, contextlib.suppress(OSError):  # a file system may not hold that much
            f.truncate(len(head) + math.prod(new_shape) * 4)
    decl["shape"] = list(new_shape)
    return "refuse"


def _is_regular(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _resolve_path(to: str, real: str) -> str:
    d, _, base = real.rpartition("/")
    return (to.replace("@real", real).replace("@REAL", real.upper()).replace("@dir", d).replace("@base", base))


def _apply_path(folder: Path, m: dict, case: dict, roles: dict) -> str:
    field = m["field"]
    try:
        parent = _at(case, field[:-1])
        real = parent[field[-1]]
    except (KeyError, IndexError, TypeError):
        return "same"
    if not isinstance(real, str):
        return "same"
    to = m["to"]
    if to == "@abs":
        outside = folder.parent / "outside.npy"
        if not outside.exists() and _is_regular(folder / real) and not os.path.isabs(real):
            shutil.copyfile(folder / real, outside)
        new = str(outside)
    else:
        new = _resolve_path(to, real)
    parent[field[-1]] = new
    arrays = case.get("arrays")
    if m["declare"] and isinstance(arrays, dict) and real in arrays and new not in arrays and new not in roles:
        arrays[new] = arrays[real]  # a hostile path declared: refused for the path, not the declaration
    if new == real:
        return "same"
    if isinstance(arrays, dict) and new in arrays and re.fullmatch(r"[a-z]+(/[a-z]+)?/[a-z_]+\.npy", new):
        return "any"  # another genuine array of the bundle
    return "refuse"


def _apply_file(folder: Path, m: dict) -> str:
    rel = m["file"]
    p = folder / rel
    moved = folder.parent / ("outside-" + rel.replace("/", "-"))
    if p.is_symlink() or not (p.is_file() or p.is_dir()) or moved.exists():
        return "same"  # swapped already
    os.rename(p, moved)  # moved, not copied: it may hold a sparse file of terabytes
    to = m["to"]
    if to == "fifo":
        os.mkfifo(p)
    elif to == "dir":
        p.mkdir()
    elif to == "link_out":
        p.symlink_to(moved)
    elif to == "link_in":
        inside = p.with_name("." + p.name + ".real")
        os.rename(moved, inside)
        p.symlink_to(inside.name)
    elif to == "dangling":
        p.symlink_to(folder / "no-such-file")
    elif to == "loop":
        p.symlink_to(p.name)
    elif to == "devzero":
        p.symlink_to("/dev/zero")
    return "refuse"  # "missing": left removed


def materialize(seed_dir: Path, desc: dict, folder: Path, rng: random.Random) -> tuple[str, str]:
    """Write the case's bundle into folder (a copy of its seed, damaged); (what it must give, a few words)."""
    shutil.copytree(seed_dir, folder, symlinks=True, copy_function=shutil.copyfile)
    cpath = folder / "case.json"
    text = cpath.read_text()
    original, case = json.loads(text), json.loads(text)
    roles = {p: r for p, r in seed_role_cache[seed_dir].items()}
    expects, words = [], []
    text_bytes = None
    for m in sorted(desc["muts"], key=lambda m: m["family"] == "text"):  # the text's damage last: it is the file's
        fam = m["family"]
        words.append(f"{fam}:{m.get('op') or m.get('to') or m.get('what') or ''}")
        if fam == "case":
            expects.append(_apply_case(case, m, folder, original))
        elif fam == "print":  # a printed string is only printed: the verdict stays
            with contextlib.suppress(KeyError, TypeError):
                _at(case, m["path"][:-1])[m["path"][-1]] = m["text"]
            expects.append("same")
        elif fam == "path":
            expects.append(_apply_path(folder, m, case, roles))
        elif fam == "arrays":
            arrays = case.get("arrays")
            if not isinstance(arrays, dict) or not isinstance(arrays.get(m["file"]), dict):
                expects.append("same")
                continue
            decl = arrays[m["file"]]
            if m["what"] == "drop":
                del arrays[m["file"]]
                expects.append("refuse")
            elif m["what"] == "entry":
                arrays[m["file"]] = m["value"]
                expects.append("refuse")
            else:
                old = decl.get(m["what"])
                decl[m["what"]] = m["value"]
                expects.append("same" if _same(m["value"], old) else "refuse")
        elif fam == "npy":
            expects.append(_apply_npy(folder, m, case, roles, rng))
        elif fam == "file":
            if cpath.is_file() and not cpath.is_symlink() and m["file"] == "case.json":
                cpath.write_text(_dump(case))  # the case.json mutations so far, then the swap
            expects.append(_apply_file(folder, m))
        elif fam == "text":
            text_bytes, e = _apply_text(_dump(case), m)
            expects.append(e)
    if _is_regular(cpath) and (text_bytes is not None or not _same(case, original)):
        cpath.write_bytes(text_bytes if text_bytes is not None else _dump(case).encode("utf-8", "surrogatepass"))
    expect = "refuse" if "refuse" in expects else "same" if all(e == "same" for e in expects) else "any"
    return expect, " + ".join(words)


seed_role_cache: dict[Path, dict] = {}


def scratch() -> str | None:
    """Where the cases are written: a tmpfs when there is one (a bundle copied, damaged and removed per
    case: on ext4 the folders' creation and removal take longer than the replay)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


# ---------------------------------------------------------------- running a case (in the worker)


class CaseTimeout(BaseException):
    """Raised by SIGALRM in a case that runs past CASE_SECONDS (BaseException: no except Exception of the
    replay can swallow it)."""


def _alarm(signum, frame):
    raise CaseTimeout()


_CONTROL = ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")


def _raw_chars(text: str) -> bool:
    return any(unicodedata.category(ch) in _CONTROL for line in text.split("\n") for ch in line)


_COUNTS = re.compile(r"\((\d+) of (\d+) differ")


def judge(expect: str, genuine: dict, code, stdout: str, stderr: str, folder: Path) -> str:
    """The case's outcome: exit0/1/2, or the failure it is."""
    if code not in (0, 1, 2):
        return "status"
    if _raw_chars(stdout) or _raw_chars(stderr):
        return "raw"
    if code == 2:
        lines = stderr.split("\n")
        if len(lines) != 2 or lines[1] or not lines[0]:
            return "multiline"
        if not lines[0].startswith(f"replay.py: {folder}"):
            return "unnamed"
        return "refused" if expect == "same" else "exit2"
    if stderr:
        return "multiline"
    last = stdout.rstrip("\n").rsplit("\n", 1)[-1]
    if not last.startswith("verdict: ") or (last.startswith("verdict: far")) != (code == 1):
        return "verdict"
    if expect == "refuse":
        return "accepted"
    counts = [list(c) for c in _COUNTS.findall(stdout)]
    if expect == "same" and (code != genuine["code"] or counts != genuine["counts"]):
        return "changed"
    return f"exit{code}"


def run_case(replay, seeds: dict[str, Path], genuine: dict, index: int, desc: dict, work: Path) -> dict:
    case_dir = work / f"c{index}"
    case_dir.mkdir()
    folder = case_dir / "bundle"
    out: dict = {"i": index}
    try:
        rng = random.Random(json.dumps(desc, sort_keys=True))
        try:
            expect, what = materialize(seeds[desc["seed"]], desc, folder, rng)
        except Exception as e:  # noqa: BLE001 - a bug of this script's, reported as such
            return {**out, "what": desc["seed"], "outcome": "harness", "t": 0.0,
                    "detail": f"{type(e).__name__}: {str(e)[:200]}"}
        out.update(what=f"{desc['seed']} {what}", expect=expect)
        so, se = io.StringIO(), io.StringIO()
        t0 = time.perf_counter()
        code = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
            try:
                with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
                    code = replay.main([str(folder)])
            except CaseTimeout:
                out["outcome"] = "hang"
            except Exception as e:  # noqa: BLE001 - what the fuzzer is here to find
                import traceback

                tb = traceback.extract_tb(e.__traceback__)
                out["outcome"] = "traceback"
                out["detail"] = f"{type(e).__name__} at line {tb[-1].lineno if tb else '?'}: {str(e)[:200]}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        out["t"] = time.perf_counter() - t0
        if "outcome" not in out:
            out["outcome"] = judge(expect, genuine[desc["seed"]], code, so.getvalue(), se.getvalue(), folder)
            out["detail"] = (se.getvalue() or so.getvalue().rstrip("\n").rsplit("\n", 1)[-1])[:300]
        if caught and out["outcome"] not in FAILURES:
            out["outcome"] = "warning"
            out["detail"] = f"{caught[0].category.__name__}: {str(caught[0].message)[:200]}"
        if out["t"] > CASE_SECONDS and out["outcome"] not in FAILURES:
            out["outcome"] = "slow"
        return out
    finally:
        shutil.rmtree(case_dir, ignore_errors=True)


def _peak_kb() -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))


def worker_main(seed_dir: str) -> None:
    """Read "index JSON" lines on stdin, answer one JSON line each on the original stdout."""
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    signal.signal(signal.SIGALRM, _alarm)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    setup = json.loads((Path(seed_dir) / "setup.json").read_text())
    seeds = {name: Path(p) for name, p in setup["seeds"].items()}
    for name, p in seeds.items():
        seed_role_cache[p] = setup["info"][name]["roles"]
    replay = load_replay(next(iter(seeds.values())) / "replay.py")
    work = Path(tempfile.mkdtemp(prefix="work-", dir=seed_dir))  # under the parent's folder: gone with it
    try:
        proto.write("ready\n")
        for line in sys.stdin:
            index, _, desc = line.partition(" ")
            out = run_case(replay, seeds, setup["genuine"], int(index), json.loads(desc), work)
            out["rss_kb"] = _peak_kb()
            proto.write(json.dumps(out) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- the parent


def prepare(root: Path) -> dict:
    """Seeds, what the strategies draw from, and each seed's genuine replay (status and counts)."""
    seeds = make_seeds(root)
    replay = load_replay(seeds["nrm"] / "replay.py")
    genuine = {}
    for name, folder in seeds.items():
        so = io.StringIO()
        with contextlib.redirect_stdout(so):
            code = replay.main([str(folder)])
        if code not in (0, 1):
            raise RuntimeError(f"the genuine {name} bundle replays with status {code}: {so.getvalue()}")
        genuine[name] = {"code": code, "counts": [list(c) for c in _COUNTS.findall(so.getvalue())]}
    setup = {"seeds": {n: str(p) for n, p in seeds.items()}, "info": seed_info(seeds), "genuine": genuine}
    (root / "setup.json").write_text(json.dumps(setup))
    return setup


class _Worker:
    def __init__(self, seed_dir: Path):
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(seed_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, cwd=ROOT,
                                     text=True, bufsize=1)
        self.case: int | None = None
        self.deadline = 0.0
        self.ready = False
        self.pending: int | None = None

    def send(self, index: int, desc: dict) -> None:
        self.case = index
        self.deadline = time.monotonic() + KILL_SECONDS
        self.proc.stdin.write(f"{index} {json.dumps(desc)}\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


def fuzz(cases: int, seed: int, workers: int = 2, log=print) -> dict:
    """Run `cases` cases; returns the figures (counts by outcome and family, failures, time, slowest)."""
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="kestrel-fuzz-bundle-seeds-", dir=scratch()))
    try:
        setup = prepare(tmp)
        seed_time = time.monotonic() - start
        descs = draw_cases(setup["info"], cases, seed)
        draw_time = time.monotonic() - start - seed_time
        r = _dispatch(descs, workers, tmp, start, log)
        r.update(seed=seed, seed_time_s=seed_time, draw_time_s=draw_time)
        return r
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dispatch(descs: list[dict], n_workers: int, seed_dir: Path, start: float, log) -> dict:
    sel = selectors.DefaultSelector()
    results: Counter = Counter()
    by_family: Counter = Counter()
    by_expect: Counter = Counter()
    failures: list[dict] = []
    max_rss, slowest, restarts, done = 0, {"t": 0.0}, 0, 0
    t_cases = time.monotonic()
    todo = iter(range(len(descs)))
    pool: list[_Worker] = []

    def spawn(index) -> None:
        w = _Worker(seed_dir)
        w.pending = index
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        pool.append(w)

    def retire(w: _Worker, outcome: str) -> None:
        nonlocal restarts
        sel.unregister(w.proc.stdout)
        pool.remove(w)
        w.kill()
        if w.case is None:
            w.err.seek(0)
            raise RuntimeError(f"a fuzz worker ended before its first case: {w.err.read()[-400:]!r}")
        results[outcome] += 1
        failures.append({"i": w.case, "outcome": outcome, "case": descs[w.case]})
        restarts += 1
        nxt = next(todo, None)
        if nxt is not None:
            spawn(nxt)

    for _ in range(min(n_workers, len(descs))):
        spawn(next(todo))
    while pool:
        now = time.monotonic()
        timeout = min([w.deadline - now for w in pool if w.case is not None] or [1.0])
        for key, _ in sel.select(timeout=max(0.0, timeout)):
            w: _Worker = key.data
            line = w.proc.stdout.readline()
            if not line:
                retire(w, "died")
                continue
            if line == "ready\n":
                w.ready = True
                w.send(w.pending, descs[w.pending])
                continue
            out = json.loads(line)
            done += 1
            results[out["outcome"]] += 1
            for fam in {m["family"] for m in descs[out["i"]]["muts"]}:
                by_family[(fam, out["outcome"])] += 1
            by_expect[(out.get("expect", "?"), out["outcome"])] += 1
            max_rss = max(max_rss, out["rss_kb"])
            if out["t"] > slowest["t"]:
                slowest = {"t": out["t"], "i": out["i"], "what": out["what"], "outcome": out["outcome"]}
            if out["outcome"] in FAILURES:
                failures.append({**out, "case": descs[out["i"]]})
            if done % 10000 == 0:
                log(f"  {done} cases, {time.monotonic() - start:.0f} s, {dict(results)}")
            nxt = next(todo, None)
            if nxt is None:
                w.case = None
                sel.unregister(w.proc.stdout)
                pool.remove(w)
                w.proc.stdin.close()
                w.proc.wait()
            else:
                w.send(nxt, descs[nxt])
        now = time.monotonic()
        for w in list(pool):
            if w.ready and w.case is not None and now > w.deadline:
                retire(w, "hang")
    t = time.monotonic() - t_cases
    return {"cases": len(descs), "workers": n_workers, "outcomes": dict(results),
            "by_family": {f"{k[0]} {k[1]}": v for k, v in sorted(by_family.items())},
            "by_expect": {f"{k[0]} {k[1]}": v for k, v in sorted(by_expect.items())}, "failures": failures,
            "time_s": time.monotonic() - start, "cases_time_s": t, "rate_per_s": len(descs) / t if t else 0.0,
            "slowest": slowest, "max_case_s": slowest["t"], "max_rss_mb": max_rss / 1024, "restarts": restarts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--worker", metavar="SEED_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--case", metavar="JSON", help="run one case (as a failure prints it) in this process")
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker)
        return 0
    if args.case:
        tmp = Path(tempfile.mkdtemp(prefix="kestrel-fuzz-bundle-", dir=scratch()))
        try:
            setup = prepare(tmp)
            seeds = {n: Path(p) for n, p in setup["seeds"].items()}
            for n, p in seeds.items():
                seed_role_cache[p] = setup["info"][n]["roles"]
            signal.signal(signal.SIGALRM, _alarm)
            (tmp / "work").mkdir()
            out = run_case(load_replay(seeds["nrm"] / "replay.py"), seeds, setup["genuine"], 0,
                           json.loads(args.case), tmp / "work")
            print(json.dumps(out, indent=2))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"seed {seed} (--seed {seed} replays it), {args.cases} cases, {args.workers} workers, RLIMIT_AS"
          f" {AS_LIMIT >> 30} GB, {CASE_SECONDS:.0f} s a case; {platform.machine()} {os.cpu_count()} cores", flush=True)
    r = fuzz(args.cases, seed, args.workers)
    print(json.dumps({k: v for k, v in r.items() if k != "failures"}, indent=2))
    for f in r["failures"][:20]:
        print("FAIL", json.dumps(f))
    print(f"{r['cases']} cases in {r['time_s']:.0f} s ({r['rate_per_s']:.0f} a second after {r['seed_time_s']:.0f} s"
          f" of seeds and {r['draw_time_s']:.0f} s drawing them); {len(r['failures'])} failures; slowest case"
          f" {r['slowest']['t']:.2f} s ({r['slowest'].get('what')})")
    return 1 if r["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

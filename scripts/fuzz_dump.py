"""Fuzz the dump reader and `kestrel-tui diff`; results/fuzz.md records a run.

    .venv/bin/python scripts/fuzz_dump.py --cases 100000 [--seed N]

The hypothesis strategies and the checks live here; tests/test_fuzz.py runs
the same ones under pytest (fewer cases, derandomized). Three targets share
``--cases`` (2/5 reader, 2/5 diff, 1/5 round trip):

* ``read``   read_dump on one file, random or mutated from a valid dump: it
  parses, or refuses with UsageError (DumpError) in one line; a file that is
  a plain valid rendering must parse to exactly its items.
* ``diff``   ``kestrel_tui.cli.main(["diff", a, b])`` in-process: exit 0, 1 or
  2 and never an exception; exit 2 is one stderr line "kestrel-tui diff:
  error: ..." naming the file at fault; exit 0 iff both files parse (read_dump,
  called separately) to equal dicts; on exit 1 stdout names the first DIFF
  (smallest order_key among the differing keys, with both hashes) or, when
  no hash differs, the first missing key, as whitespace-separated words
  (Rich markup in a tag must come out as the tag).
* ``roundtrip``  write_dump(items) then read_dump gives the same dict in the
  same order and the writer's exact bytes; write_dump may refuse (UsageError)
  only items holding an index beyond 2^31-1.

Every outcome is counted; a property violation or any other exception is
counted by type, its first input is printed, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kestrel_tui.cli import main as cli_main  # noqa: E402
from kestrel_tui.errors import UsageError  # noqa: E402
from kestrel_tui.trace.dump import read_dump, write_dump  # noqa: E402
from kestrel_tui.trace.keys import FIELDS, order_key  # noqa: E402

MAX_INDEX = 2**31 - 1
TAG_CHARS = "".join(chr(c) for c in range(0x21, 0x7F))  # printable ASCII, no space
_TAG_RE = re.compile(r"[\x21-\x7e]+")

# ---- strategies ----------------------------------------------------------

HASH64 = st.integers(0, 2**64 - 1)
MARKUP = ("[", "]", "[/x]", "[red]", "[/]", "[/red]", "[b]", "[bold]", "[link=x]", "\\[", "[[", "]]",
          "[red", "red]", ":x:", "[@click=app.quit]", "[#ff0000]", "[not", "]x[")
_INDEX = st.one_of(
    st.integers(0, 40).map(str),
    st.sampled_from(["2147483647", "2147483648", "1000000000", "4294967296", "9" * 30, "1" + "0" * 29,
                     "00", "007", "-1", "+1", "1_0", "\uff11"]),  # the last: a fullwidth digit (UTF-8)
    st.integers(0, 10**40).map(str),
)
_FIELD = st.sampled_from((*FIELDS, "emb", "logits", "foo", "Moe_2", "x_"))
KEY_TAG = st.one_of(
    st.builds(lambda t: f"t{t}_emb", _INDEX),
    st.builds(lambda t: f"t{t}_logits", _INDEX),
    st.builds(lambda t, l, f: f"t{t}_l{l}_{f}", _INDEX, _INDEX, _FIELD),
)
# beyond int()'s 4300-digit limit: parse_key must not trip on it (rare: it makes big files)
LONG_INDEX_TAG = st.integers(4290, 4400).map(lambda n: f"t{'1' * n}_emb")
MARKUP_TAG = st.lists(st.one_of(st.sampled_from(MARKUP), KEY_TAG, st.text(TAG_CHARS, min_size=1, max_size=4)),
                      min_size=1, max_size=4).map("".join)
ASCII_TAG = st.text(TAG_CHARS, min_size=1, max_size=24)
_SMALL = st.integers(0, 40)
SMALL_KEY_TAG = st.one_of(st.builds(lambda t: f"t{t}_emb", _SMALL), st.builds(lambda t: f"t{t}_logits", _SMALL),
                          st.builds(lambda t, l, f: f"t{t}_l{l}_{f}", _SMALL, _SMALL, _FIELD))
ANY_TAG = st.one_of(SMALL_KEY_TAG, SMALL_KEY_TAG, KEY_TAG, MARKUP_TAG, ASCII_TAG)
VALID_TAG = st.one_of(KEY_TAG, MARKUP_TAG, ASCII_TAG).filter(lambda t: _TAG_RE.fullmatch(t) is not None)

# ("/" cannot be in a file name, so no closing markup tag here; tags carry those)
FILE_NAMES = ("a.txt", "dump.txt", "[red]a.txt", "[b]x]", "a b.txt", "[[x", "x.partial", "x.partial.2",
              "ref.txt.partial")
FILE_NAME = st.one_of(st.just("a.txt"), st.sampled_from(FILE_NAMES))
# pairs: mostly files that parse, so that exit 0/1 (where tags are printed) get their share
PAIR_NAME = st.one_of(st.just("a.txt"), st.just("a.txt"), st.just("a.txt"), st.sampled_from(FILE_NAMES))
PAIR_TAG = st.one_of(*[SMALL_KEY_TAG] * 6, MARKUP_TAG, MARKUP_TAG, ASCII_TAG, KEY_TAG).filter(
    lambda t: _TAG_RE.fullmatch(t) is not None)


def items_strategy(tag=VALID_TAG, min_size=0, max_size=10):
    return st.lists(st.tuples(tag, HASH64), min_size=min_size, max_size=max_size, unique_by=lambda it: it[0])


def huge_index(tag: str) -> bool:
    """A digit run beyond 2^31-1 (int32): a tag read_dump may refuse (checked without int())."""
    runs = (d.lstrip("0") for d in re.findall(r"[0-9]+", tag))
    return any(len(d) > 10 or (len(d) == 10 and int(d) > MAX_INDEX) for d in runs)


def partial_name(name: str) -> bool:
    return re.search(r"\.partial(\.[0-9]+)?$", name) is not None


@dataclass(frozen=True)
class FileCase:
    data: bytes
    name: str = "a.txt"
    expected: dict | None = None  # a plain valid rendering: what read_dump must return (name permitting)
    how: str = ""                  # the mutations applied, for the report

    def __repr__(self) -> str:
        return f"FileCase(name={self.name!r}, data={self.data!r}, how={self.how!r})"


_EOLS = (b"\n", b"\r\n")


def _hex(h: int, case: str) -> bytes:
    s = f"{h:016x}"
    if case == "upper":
        s = s.upper()
    elif case == "mixed":
        s = "".join(c.upper() if i % 2 else c for i, c in enumerate(s))
    return s.encode()


_LINE_MUTATIONS = ("cr", "crcr", "blank_mid", "dup", "sep", "trailing", "leading", "hexlen", "nonhex", "hex0x",
                   "tag_markup", "tag_huge", "non_utf8", "utf8", "ctrl", "delete", "swap", "empty_tag",
                   "tag_space", "upper")
_GLOBAL_MUTATIONS = ("bom", "insert_bytes", "truncate", "blank_end", "no_final_eol", "only_cr")


@st.composite
def rendered(draw, items, mutations=None, name=None):
    """A dump file of `items`: LF/CRLF/mixed line ends, hex case, trailing blank lines, then mutations."""
    eol_style = draw(st.sampled_from(("lf", "lf", "crlf", "mixed")))
    hex_case = draw(st.sampled_from(("lower", "lower", "upper", "mixed")))
    lines = []
    for tag, h in items:
        eol = {"lf": b"\n", "crlf": b"\r\n"}.get(eol_style) or draw(st.sampled_from(_EOLS))
        lines.append([tag.encode(), b" ", _hex(h, hex_case), eol])
    tail = draw(st.sampled_from((b"", b"", b"\n", b"\r\n", b"\n\n", b"\r\n\n")))
    if name is None:
        name = draw(FILE_NAME)
    n_mut = draw(st.one_of(st.just(0), st.integers(1, 4))) if mutations is None else mutations
    muts = [draw(st.sampled_from(_LINE_MUTATIONS + _GLOBAL_MUTATIONS)) for _ in range(n_mut)]
    post = []
    for m in muts:
        if m in _GLOBAL_MUTATIONS:
            post.append(m)
            continue
        if not lines:
            lines.append([b"t0_emb", b" ", b"0123456789abcdef", b"\n"])
        i = draw(st.integers(0, len(lines) - 1))
        ln = lines[i]
        if m == "cr":
            ln[3] = b"\r"
        elif m == "crcr":
            ln[3] = b"\r\r\n"
        elif m == "blank_mid":
            ws = draw(st.sampled_from((b"", b"", b" ", b"\t", b"  ", b"\x0b", b"\x0c", b"\r")))
            lines.insert(i, [ws, b"", b"", draw(st.sampled_from(_EOLS))])
        elif m == "dup":
            new = list(ln)
            if draw(st.booleans()):
                new[2] = _hex(draw(HASH64), "lower")
            lines.insert(draw(st.integers(0, len(lines))), new)
        elif m == "sep":
            ln[1] = draw(st.sampled_from((b"", b"  ", b"   ", b"\t", b" \t", b"\t ", b"\x0b", b"\xa0", b"\xc2\xa0",
                                          b"\x00", b"\r")))
        elif m == "trailing":
            ln[2] += draw(st.sampled_from((b" ", b"  ", b"\t", b"\x00", b"\x0c", b" x", b"\r")))
        elif m == "leading":
            ln[0] = draw(st.sampled_from((b" ", b"  ", b"\t"))) + ln[0]
        elif m == "hexlen":
            k = draw(st.integers(0, 24))
            ln[2] = (ln[2] * 2)[:k]
        elif m == "nonhex":
            j = draw(st.integers(0, max(len(ln[2]) - 1, 0)))
            ln[2] = ln[2][:j] + draw(st.sampled_from((b"g", b"G", b"x", b"-", b"+", b"_", b"\xff", b"z"))) + ln[2][j + 1:]
        elif m == "hex0x":
            ln[2] = b"0x" + (ln[2] if draw(st.booleans()) else ln[2][2:])
        elif m == "tag_markup":
            ln[0] = draw(MARKUP_TAG).encode()
        elif m == "tag_huge":
            ln[0] = draw(st.one_of(KEY_TAG, LONG_INDEX_TAG) if draw(st.integers(0, 9)) == 0 else KEY_TAG).encode()
        elif m in ("non_utf8", "utf8", "ctrl"):
            pool = {"non_utf8": (b"\xff", b"\x80", b"\xc3\x28", b"\xe9", b"\xed\xa0\x80", b"\xfe\xff"),
                    "utf8": ("\u00e9".encode(), "\u2028".encode(), "\u0085".encode(), "\uff54".encode(),
                             "\ufeff".encode()),
                    "ctrl": (b"\x00", b"\x1b[31m", b"\x7f", b"\x08", b"\x1c", b"\x1e", b"\x85")}[m]
            field = draw(st.sampled_from((0, 2)))
            j = draw(st.integers(0, len(ln[field])))
            ln[field] = ln[field][:j] + draw(st.sampled_from(pool)) + ln[field][j:]
        elif m == "delete":
            del lines[i]
        elif m == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif m == "empty_tag":
            ln[0] = b""
        elif m == "tag_space":
            j = draw(st.integers(0, len(ln[0])))
            ln[0] = ln[0][:j] + b" " + ln[0][j:]
        elif m == "upper":
            ln[2] = ln[2].upper()
    data = b"".join(b"".join(ln) for ln in lines) + tail
    for m in post:
        if m == "bom":
            data = b"\xef\xbb\xbf" + data
        elif m == "insert_bytes":
            j = draw(st.integers(0, len(data)))
            data = data[:j] + draw(st.binary(min_size=1, max_size=6)) + data[j:]
        elif m == "truncate":
            data = data[:draw(st.integers(0, len(data)))]
        elif m == "blank_end":
            data += draw(st.sampled_from((b"\n", b"\n\n\n", b"\r\n\r\n", b" \n", b"\t\n", b"  ")))
        elif m == "no_final_eol":
            data = data.rstrip(b"\r\n")
        elif m == "only_cr":
            data = data.replace(b"\n", b"\r")
    expected = None
    if not muts and items and all(_TAG_RE.fullmatch(t) and not huge_index(t) for t, _ in items):
        expected = dict(items)
    return FileCase(data, name, expected, ",".join(muts))


@st.composite
def random_text(draw):
    """Lines from a small alphabet of dump-ish characters joined by random line ends."""
    alphabet = "t0123456789_lembogitsnrmx abcdefABCDEF[]/\\\t\r:!~#" + "\u00e9\ufeff"
    lines = draw(st.lists(st.text(alphabet, max_size=30), max_size=8))
    eols = [draw(st.sampled_from(("\n", "\r\n", "\r", ""))) for _ in lines]
    return FileCase("".join(a + b for a, b in zip(lines, eols)).encode(), draw(FILE_NAME), how="random_text")


TINY = st.builds(lambda d, n: FileCase(d, n, how="tiny"),
                 st.sampled_from((b"", b"\n", b"\r\n", b"\r", b" ", b"\t", b"\n\n", b"\xef\xbb\xbf",
                                  b"\xef\xbb\xbf\n", b" \n", b"\x00", b"\xff\xfe", b"t0_emb",
                                  b"t0_emb 0123456789abcdef", b"t0_emb 0123456789ABCDEF\r\n",
                                  b"t1000000000_emb 0123456789abcdef\n",
                                  b"t" + b"9" * 30 + b"_l" + b"9" * 30 + b"_nrm 0123456789abcdef\n")),
                 FILE_NAME)
BINARY = st.builds(lambda d, n: FileCase(d, n, how="binary"), st.binary(max_size=300), FILE_NAME)


@st.composite
def mutated(draw):
    return draw(rendered(draw(items_strategy(ANY_TAG, 0, 10))))


FILE_CASE = st.one_of(mutated(), mutated(), mutated(), random_text(), TINY, BINARY)


@st.composite
def dump_pair(draw):
    """Two files: independent, identical bytes, or one set of items rendered twice with edits between."""
    kind = draw(st.sampled_from(("independent", "same", "reformat", "flip", "drop", "add", "mixed",
                                 "reformat", "flip", "mixed")))
    if kind == "independent":
        return draw(FILE_CASE), draw(FILE_CASE)
    if kind == "same":
        a = draw(FILE_CASE)
        return a, FileCase(a.data, draw(FILE_NAME), a.expected, a.how)
    items = draw(items_strategy(PAIR_TAG, 1, 10))
    other = list(items)
    if kind in ("flip", "mixed"):
        for i in draw(st.lists(st.integers(0, len(other) - 1), min_size=1, max_size=3)):
            tag, h = other[i]
            other[i] = (tag, draw(st.one_of(st.just(h ^ 1), HASH64)))
    if kind in ("drop", "mixed") and draw(st.booleans()) or kind == "drop":
        for i in sorted(set(draw(st.lists(st.integers(0, len(other) - 1), min_size=1, max_size=3))),
                        reverse=True):
            del other[i]
    if kind in ("add", "mixed"):
        seen = {t for t, _ in other}
        for tag, h in draw(items_strategy(PAIR_TAG, 1 if kind == "add" else 0, 3)):
            if tag not in seen:
                seen.add(tag)
                other.insert(draw(st.integers(0, len(other))), (tag, h))
    if draw(st.booleans()):
        other = draw(st.permutations(other))
    clean = st.one_of(st.just(0), st.just(0), st.just(0), st.integers(1, 2))
    return (draw(rendered(items, draw(clean), draw(PAIR_NAME))),
            draw(rendered(other, draw(clean), draw(PAIR_NAME))))


# at least one item: read_dump refuses an empty file by design (write_dump([]) writes one; see results/fuzz.md)
ROUNDTRIP_ITEMS = items_strategy(VALID_TAG, 1, 16)

# ---- checks --------------------------------------------------------------


def _category(msg: str) -> str:
    """A refusal's reason, without paths, line numbers and quoted parts."""
    m = msg.split("malformed line: ", 1)[-1]
    for needle, cat in (("partial", "partial file name"), ("empty dump", "empty file"), ("BOM", "BOM"),
                        ("byte-order", "BOM"), ("non-ASCII", "non-ASCII byte"), ("blank line", "blank line"),
                        ("duplicate", "duplicate key"), ("tab at", "tab"), ("carriage return", "lone CR"),
                        ("control character", "control character"), ("index", "index beyond 2^31-1"),
                        ("hex digits", "wrong hash length"), ("not hexadecimal", "hash not hex"),
                        ("bad characters", "bad tag characters"), ("empty tag", "empty tag"),
                        ("fields", "field count"), ("space", "spaces"), ("cannot read", "unreadable")):
        if needle in m:
            return cat
    return "other: " + " ".join(_scrub(m).split()[:4])


def _scrub(msg: str) -> str:
    """A message without paths, quoted parts and numbers, so that one kind of failure counts once."""
    return " ".join(re.sub(r"'[^']*'|\S*/\S*|[0-9]+", "_", msg).split())[:90]


def write_case(folder: Path, case: FileCase) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / case.name
    p.write_bytes(case.data)
    return p


def _read_or_error(path: Path) -> dict | UsageError:
    try:
        return read_dump(path)
    except UsageError as e:
        return e


def check_read(case: FileCase, workdir: Path) -> str:
    """read_dump parses or refuses with a one-line UsageError; returns the outcome's name."""
    path = write_case(workdir / "read", case)
    got = _read_or_error(path)  # any other exception propagates: that is the bug
    must_parse = case.expected is not None and not partial_name(case.name)
    if isinstance(got, UsageError):
        msg = str(got)
        assert len(msg.splitlines()) == 1 and msg.strip(), f"not a one-line message: {msg!r}"
        assert not must_parse, f"a valid dump refused: {msg}"
        return f"refused: {_category(msg)}"
    assert isinstance(got, dict)
    for tag, h in got.items():
        assert isinstance(tag, str) and _TAG_RE.fullmatch(tag), tag
        assert isinstance(h, int) and 0 <= h < 2**64, (tag, h)
        assert f"{tag} {h:016x}".lower().encode() in case.data.lower(), f"{tag} {h:016x} is not in the file"
    segments = case.data.split(b"\n")
    while segments and not segments[-1].strip():
        segments.pop()
    assert len(got) == len(segments), f"{len(segments)} lines but {len(got)} keys: a line was skipped"
    if must_parse:
        assert list(got.items()) == list(case.expected.items())
    return "parsed"


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    return code, _ANSI.sub("", out.getvalue()), _ANSI.sub("", err.getvalue())


def _line_with(out: str, start: list[str]) -> list[str]:
    for line in out.splitlines():
        words = line.split()
        if words[:len(start)] == start:
            return words[len(start):]
    raise AssertionError(f"no line starting {' '.join(start)!r} in stdout:\n{out}")


def check_diff(pair: tuple[FileCase, FileCase], workdir: Path) -> str:
    """`kestrel-tui diff A B` in-process against read_dump's own verdict; returns "exit N"."""
    pa, pb = write_case(workdir / "a", pair[0]), write_case(workdir / "b", pair[1])
    da, db = _read_or_error(pa), _read_or_error(pb)
    code, out, err = run_cli(["diff", str(pa), str(pb)])  # an exception here is the bug
    assert code in (0, 1, 2), code
    bad = pa if isinstance(da, UsageError) else pb if isinstance(db, UsageError) else None
    expected = 2 if bad else 0 if da == db else 1
    assert code == expected, f"exit {code}, expected {expected}\nstdout:\n{out}\nstderr:\n{err}"
    if code == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and err.endswith("\n"), f"stderr is not one line: {err!r}"
        assert lines[0].startswith("kestrel-tui diff: error:"), err
        assert str(bad) in lines[0], f"the error does not name {bad}: {err!r}"
        assert out == "", out
        return "exit 2"
    assert err == "", err
    if code == 0:
        assert "identical" in out and f"{len(da)} keys" in out, f"exit 0 without 'identical: {len(da)} keys':\n{out}"
        return "exit 0"
    differ = [k for k in da.keys() & db.keys() if da[k] != db[k]]
    if differ:
        k = min(differ, key=order_key)
        want = [k, f"{da[k]:016x}", "!=", f"{db[k]:016x}"]
        assert _line_with(out, ["first", "DIFF:"]) == want, f"first DIFF is not {' '.join(want)}:\n{out}"
    else:  # only keys missing on one side: the first of those
        k = min(da.keys() ^ db.keys(), key=order_key)
        status = "(missing_sub)" if k in da else "(missing_ref)"
        assert _line_with(out, ["first", "missing:"]) == [k, status], f"first missing is not {k} {status}:\n{out}"
    return "exit 1"


def check_roundtrip(items: list[tuple[str, int]], workdir: Path, n: int) -> str:
    folder = workdir / "rt"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"d{n}.txt"
    try:
        write_dump(path, items)
    except UsageError as e:
        for p in folder.glob(f"d{n}.txt*"):
            p.unlink()
        assert any(huge_index(t) for t, _ in items), f"write_dump refused valid items: {e}"
        assert not path.exists()
        return "write refused (index beyond 2^31-1)"
    try:
        got = _read_or_error(path)
        assert not isinstance(got, UsageError), f"write_dump wrote a file that read_dump refuses: {got}"
        assert list(got.items()) == list(items)
        assert path.read_bytes() == b"".join(f"{t} {h:016x}\n".encode() for t, h in items)
    finally:
        path.unlink()
    return "round trip ok"


# ---- the runner ----------------------------------------------------------

def _run(name, strategy, check, n, seed_value, outcomes, failures):
    @seed(seed_value)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def target(x):
        try:
            outcomes[name][check(x)] += 1
        except AssertionError as e:
            kind = "property violated: " + _scrub((str(e).splitlines() or ["(assert)"])[0])
            outcomes[name][kind] += 1
            failures.setdefault((name, kind), (x, e))
        except Exception as e:  # noqa: BLE001 -- counting them is the point
            kind = f"unexpected {type(e).__module__}.{type(e).__qualname__}"
            outcomes[name][kind] += 1
            failures.setdefault((name, kind), (x, e))

    t0 = time.perf_counter()
    target()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000, help="cases over all three targets")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    args = ap.parse_args(argv)
    seed_value = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    n_read, n_diff = args.cases * 2 // 5, args.cases * 2 // 5
    n_rt = args.cases - n_read - n_diff
    outcomes = {k: Counter() for k in ("read", "diff", "roundtrip")}
    failures: dict = {}
    print(f"seed {seed_value}; {args.cases} cases: read {n_read}, diff {n_diff}, roundtrip {n_rt}", flush=True)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kestrel-fuzz-") as tmp:
        work = Path(tmp)
        counter = iter(range(10**12))
        for name, strategy, check, n in (
                ("read", FILE_CASE, lambda c: check_read(c, work), n_read),
                ("diff", dump_pair(), lambda p: check_diff(p, work), n_diff),
                ("roundtrip", ROUNDTRIP_ITEMS, lambda it: check_roundtrip(it, work, next(counter)), n_rt)):
            dt = _run(name, strategy, check, n, seed_value, outcomes, failures)
            total = sum(outcomes[name].values())
            print(f"\n{name}: {total} cases in {dt:.1f} s", flush=True)
            for kind, count in sorted(outcomes[name].items(), key=lambda kv: (-kv[1], kv[0])):
                print(f"  {count:7d}  {kind}")
    wall = time.perf_counter() - t_all
    n_cases = sum(sum(c.values()) for c in outcomes.values())
    print(f"\n{n_cases} cases in {wall:.1f} s; {len(failures)} kinds of failure")
    for (name, kind), (x, e) in failures.items():
        print(f"\n[{name}] {kind}\n  input: {x!r}\n  {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

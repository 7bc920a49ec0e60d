"""Fuzzers for dump files: read_dump, `kestrel-tui diff` end to end, write/read round trip.

The strategies and the checks are scripts/fuzz_dump.py's, which runs 10^5 cases
of them (results/fuzz.md); here 10^4 in all, derandomized so that CI runs the
same cases in a fresh clone (no example database is read or written). What is
checked (see the script's docstring): read_dump parses or raises UsageError
(DumpError) with a one-line message; `diff` exits 0, 1 or 2 and never raises,
exit 2 is one stderr line "kestrel-tui diff: error: ...", exit 0 exactly when
both files parse to equal dicts (read_dump called separately), exit 1 names
the first DIFF or missing key as it is; write_dump then read_dump gives the
same items in the same order.
"""
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings

_path = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_dump.py"
_spec = importlib.util.spec_from_file_location("fuzz_dump", _path)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_dump"] = fuzz
_spec.loader.exec_module(fuzz)
FileCase = fuzz.FileCase

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.large_base_example])

GOOD = b"t0_emb 0123456789abcdef\nt0_l0_nrm 00000000000000ff\n"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(FUZZ, max_examples=4500)
@given(case=fuzz.FILE_CASE)
@example(case=FileCase(b""))
@example(case=FileCase(b"\xef\xbb\xbf" + GOOD))
@example(case=FileCase(b"t0_emb 0123456789abcdef\rt0_l0_nrm 00000000000000ff\n"))  # lone CR
@example(case=FileCase(b"t0_emb 0123456789ABCDEF\r\nt0_l0_nrm 00000000000000ff\n\n\r\n",
                       expected={"t0_emb": 0x0123456789ABCDEF, "t0_l0_nrm": 0xFF}))
@example(case=FileCase(b"t1000000000_emb 0123456789abcdef\n", expected={"t1000000000_emb": 0x0123456789ABCDEF}))
@example(case=FileCase(b"t" + b"9" * 30 + b"_l" + b"1" * 30 + b"_nrm 0123456789abcdef\n"))
@example(case=FileCase(b"t" + b"1" * 4301 + b"_emb 0123456789abcdef\n"))  # beyond int()'s digit limit
@example(case=FileCase(b"t0_emb\t0123456789abcdef\nt0_l0_nrm  00000000000000ff \n"))
@example(case=FileCase(b"t0_emb 0123456789abcdef\n\nt0_l0_nrm 00000000000000ff\n"))  # blank line inside
@example(case=FileCase(b"t0_emb 0123456789abcdef\nt0_emb 0123456789abcdef\n"))
@example(case=FileCase(b"t0_emb 0123456789abcde\nt0_l0_nrm 00000000000000ff0\n"))
@example(case=FileCase(b"t0_\xffemb 0123456789abcdef\n"))
@example(case=FileCase(GOOD, name="x.partial"))
def test_read_dump_parses_or_refuses_in_one_line(work, case):
    fuzz.check_read(case, work)


@settings(FUZZ, max_examples=2500)
@given(pair=fuzz.dump_pair())
@example(pair=(FileCase(b"[/x] 0000000000000000\n"), FileCase(b"[/x] 0000000000000001\n")))
@example(pair=(FileCase(b"[red] 0000000000000000\nt0_emb 0000000000000000\n"),
               FileCase(b"[red] 0000000000000001\nt0_emb 0000000000000000\n")))
@example(pair=(FileCase(b"t0_emb 0000000000000000\n[/]x[ 0000000000000000\n"),
               FileCase(b"t0_emb 0000000000000000\n")))
@example(pair=(FileCase(b"t0_emb 0000000000000000\n"),
               FileCase(b"t0_emb 0000000000000000\n[bold]y[/bold] 0000000000000000\n")))
@example(pair=(FileCase(GOOD, name="[red]a.txt"),
               FileCase(b"t0_emb 0123456789ABCDEF\r\nt0_l0_nrm 00000000000000FF\r\n", name="[b]x]")))
@example(pair=(FileCase(GOOD), FileCase(b"t1000000000_emb 0123456789abcdef\n")))
@example(pair=(FileCase(GOOD), FileCase(GOOD, name="ref.txt.partial")))
@example(pair=(FileCase(b"\xef\xbb\xbf" + GOOD), FileCase(GOOD)))
@example(pair=(FileCase(GOOD), FileCase(b"")))
@example(pair=(FileCase(b"t" + b"9" * 30 + b"_emb 0000000000000000\n"),
               FileCase(b"t" + b"9" * 30 + b"_emb 0000000000000001\n")))
def test_diff_cli_exit_status_and_output(work, pair):
    fuzz.check_diff(pair, work)


_counter = itertools.count()


@settings(FUZZ, max_examples=3000)
@given(items=fuzz.ROUNDTRIP_ITEMS)
@example(items=[("[/x]", 0), ("[red]", 2**64 - 1), ("t0_emb", 1)])
@example(items=[("t2147483647_l2147483647_x", 5)])
@example(items=[("t1000000000_emb", 5), ("t2147483648_emb", 6)])
def test_write_then_read_round_trips_in_order(work, items):
    fuzz.check_roundtrip(items, work, next(_counter))

"""Numbers the user gives (bounds.py), and every numeric option and profile field that takes one:
finite, in range, written in ASCII digits, refused in one line that says what was given and what is
allowed. A fuzzer over the text a user may type checks that nothing else gets through."""
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_tui.engines.process import parse_options
from kestrel_tui.errors import UsageError

from clitools import one_line_error, run_cli as run

_ASCII_REAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")

def _numbers():
    from kestrel_tui.bounds import SECONDS, Number

    return [Number(whole=True, lo=1, hi=2**31 - 1), Number(lo=0, above=True, hi=65536, unit="MB"),
            Number(whole=True, lo=0, unit="ULPs"), Number(lo=0), SECONDS]


# what a user may type: digits of other scripts, words float() takes, separators, signs, exponents
PIECES = st.sampled_from(["0", "1", "7", "64", "9" * 30, ".", "e", "E", "-", "+", "_", " ", "e400", "e-400",
                          "nan", "NaN", "inf", "Infinity", "١", "٣", "۱", "１", "𝟏", "x", ",", "1e308", "0x1"])
TYPED = st.lists(PIECES, max_size=6).map("".join)


@settings(max_examples=2000, deadline=None)
@given(text=TYPED, i=st.integers(0, 4))
def test_a_number_is_what_its_ascii_text_reads_or_one_line(text, i):
    from kestrel_tui.bounds import shown

    n = _numbers()[i]
    try:
        x = n.parse(text, "--opt")
    except UsageError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(f"--opt {shown(text)}: ") and f"want {n.allowed()}" in msg
        return
    body = text.strip()
    assert body.isascii() and _ASCII_REAL.fullmatch(body), text  # no digits of another script, no nan/inf
    assert math.isfinite(x) and x == (int(body) if n.whole else float(body))
    assert (n.lo is None or x >= n.lo) and (n.hi is None or x <= n.hi) and not (n.above and x == n.lo)


@pytest.mark.parametrize("given_, says", [
    ("nan", "is not finite"), ("inf", "is not finite"), ("1e400", "is not finite"), ("-1", "is below 0"),
    ("0", "is not above 0"), ("1e6", "is above 65536"), ("١", "is not a number, written with the digits 0-9"),
    ("6_4", "is not a number, written without '_'"),
])
def test_max_mb_refuses_what_would_switch_the_bound_off(given_, says):
    from kestrel_tui.session.repro import MAX_MB

    with pytest.raises(UsageError) as e:
        MAX_MB.parse(given_, "--max-mb")
    assert str(e.value) == f"--max-mb {given_!r}: {says}; want a number of MB above 0 and at most 65536"


@pytest.mark.parametrize("argv, says", [
    (["repro", "B", "--tokens", "1", "--max-mb", "nan"], "--max-mb 'nan': is not finite; want a number of MB above 0"),
    (["repro", "B", "--tokens", "1", "--max-mb", "inf"], "--max-mb 'inf': is not finite"),
    (["repro", "B", "--tokens", "1", "--max-mb", "1e400"], "--max-mb '1e400': is not finite"),
    (["run", "--tokens", "١"], "--tokens '١': is not a whole number, written with the digits 0-9; want a whole"
                               " number of tokens from 1 to 2147483647"),
    (["run", "--tokens", "1_6"], "--tokens '1_6': is not a whole number, written without '_'"),
    (["generate", "--prompt-ids", "5,٣"], "--prompt-ids '5,٣': '٣' is not a whole number, written with the digits"),
    (["graft", "--limit", "nan"], "--limit 'nan': is not finite; want a whole number of sources >= 1"),
    (["iso", "--m", "1e9"], "--m '1e9': is not a whole number; want a whole number of columns from 1 to"),
])
def test_numeric_options_are_one_line_exit_2_before_any_run(capsys, tmp_path, argv, says):
    argv = [str(tmp_path / a) if a == "B" else a for a in argv]
    code, out, err = run(capsys, *argv, "--no-cache")
    assert code == 2 and out == "" and says in one_line_error(err)
    assert not (tmp_path / "B").exists()


def test_write_bundle_refuses_nan_itself(small_model, tmp_path):
    """The bound is checked where the bundle is made, not only by the command line."""
    from kestrel_tui.session.inputs import default_prompt
    from kestrel_tui.session.repro import write_bundle
    from kestrel_tui.session.session import RunSettings, Session

    session = Session(small_model, default_prompt(small_model.cfg.vocab, 4), 1, subject="sim")
    result = session.run(RunSettings(exact=frozenset()), record=False)
    with pytest.raises(UsageError, match=r"^--max-mb nan: is not finite"):
        write_bundle(session, result, tmp_path / "b", max_mb=float("nan"))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("value, says", [
    (math.inf, "inf: is not finite"), (math.nan, "nan: is not finite"), (0, "0: is not above 0"),
    (10**9, "1000000000: is above 604800"), ("5", "'5': is a string"), (True, "True: is not a number"),
])
def test_a_process_timeout_is_finite_and_in_range(value, says):
    with pytest.raises(UsageError) as e:
        parse_options({"command": "true", "dump_env": "D", "timeout": value})
    msg = str(e.value)
    assert f"`timeout` {says}" in msg and "want a number of seconds above 0 and at most 604800" in msg
    assert parse_options({"command": "true", "dump_env": "D", "timeout": 2}).timeout == 2.0


def test_a_profile_timeout_of_inf_is_one_line_at_its_line(capsys, tmp_path):
    prof = tmp_path / "p.toml"
    prof.write_text('[reference]\nengine = "cpu"\n[subject]\nengine = "process"\n[subject.options]\n'
                    'command = "true"\ndump_env = "D"\ntimeout = inf\n')
    code, _, err = run(capsys, "run", "--profile", prof, "--tokens", "1")
    line = one_line_error(err)
    assert code == 2 and f"{prof}:8: subject.options.timeout:" in line and "is not finite" in line


def test_profile_tokens_beyond_a_key_index_is_one_line(capsys, tmp_path):
    prof = tmp_path / "p.toml"
    prof.write_text(f'tokens = {2**31}\n[reference]\nengine = "cpu"\n[subject]\nengine = "sim"\n')
    code, _, err = run(capsys, "run", "--profile", prof)
    line = one_line_error(err)
    assert code == 2 and f"{prof}:1: tokens: {2**31} is above 2147483647" in line

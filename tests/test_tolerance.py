"""Tolerance-aware comparison: NMSE / max rel. err / max ULP, close vs far, --tol."""
import json

import numpy as np
import pytest

from kestrel_tui.cli import main
from kestrel_tui.errors import UsageError
from kestrel_tui.trace.compare import (CLOSE, FAR, NAN_ULP, UNCOMPARABLE, KeyMetrics, Status, Tolerance, classify,
                                       key_metrics, parse_tolerance)
from kestrel_tui.trace.keys import order_key

f32 = np.float32
INF = float("inf")


def m(ref, sub, dtype=np.float32):
    return key_metrics(np.array(ref, dtype), np.array(sub, dtype))


# ---- metrics against hand-computed values --------------------------------

def test_metrics_simple():
    # nmse = 0.5^2 / (1 + 4) ; rel = 0.5/2 ; 2.0 -> 2.5 in f32 is 0.5 / 2^-22 = 2^21 ULPs
    assert m([1, 2], [1, 2.5]) == KeyMetrics(0.05, 0.25, 1 << 21)


def test_nmse_reference_is_the_denominator():
    # sum((a-b)^2) = 1 either way; sum(ref^2) is 1 or 4
    assert m([1], [2]).nmse == 1.0 and m([2], [1]).nmse == 0.25
    assert m([1], [2]).max_rel_err == 1.0 and m([2], [1]).max_rel_err == 0.5


def test_nmse_exact_with_many_elements():
    got = m([1, 1, 1, 1], [1, 1, 1, 1.5])
    assert got.nmse == 0.0625 and got.max_rel_err == 0.5 and got.max_ulp == 1 << 22


def test_identical_and_empty():
    assert m([1, -2, 3], [1, -2, 3]) == KeyMetrics(0.0, 0.0, 0)
    assert m([], []) == KeyMetrics(0.0, 0.0, 0)


def test_signed_zero_is_zero_error():
    got = m([0.0, 1.0], [-0.0, 1.0])
    assert got == KeyMetrics(0.0, 0.0, 0)
    assert classify(Status.DIFF, np.array([0.0], f32), np.array([-0.0], f32), Tolerance(nmse=0.0)) == (CLOSE, got)


def test_zero_reference():
    # all-zero reference, nonzero subject: 0 denominator with a nonzero numerator is inf
    got = m([0, 0], [0, 1e-30])
    assert got.nmse == INF and got.max_rel_err == INF and got.max_ulp > 0
    # one zero reference element: nmse finite, rel err inf
    got = m([0, 2], [1, 2])
    assert got.nmse == 0.25 and got.max_rel_err == INF


def test_nan_mismatch_is_far_whatever_the_tolerance():
    got = m([1, np.nan], [1, 1])
    assert got.nonfinite == 1 and got.nmse == INF and got.max_rel_err == INF and got.max_ulp == NAN_ULP
    assert not Tolerance(nmse=1e300, ulp=None, rel=None).holds(got)
    assert not Tolerance(nmse=None, ulp=None, rel=None).holds(got)


def test_equal_nan_and_inf_drop_out():
    got = m([np.nan, np.inf, 1], [np.nan, np.inf, 1.5])
    assert got == KeyMetrics(0.25, 0.5, 1 << 22)


def test_inf_mismatches():
    for ref, sub in (([np.inf], [-np.inf]), ([np.inf], [np.finfo(f32).max]), ([1.0], [np.inf])):
        got = m(ref, sub)
        assert got.nonfinite == 1 and got.nmse == INF, (ref, sub)
    assert m([np.inf], [np.finfo(f32).max]).max_ulp == 1  # one step beyond max


def test_denormals():
    tiny = np.array([np.ldexp(1.0, -149)], f32)  # smallest f32 denormal
    got = key_metrics(tiny, tiny * 2)
    assert got == KeyMetrics(1.0, 1.0, 1)
    # f64 denormals: their squares underflow to 0 in f64, so unscaled sums would give 0/0
    tiny64 = np.array([5e-324, 1e-323])
    got = key_metrics(tiny64, np.array([1e-323, 1e-323]))
    assert got == KeyMetrics(1.0 / 5.0, 1.0, 1)


def test_large_f64_does_not_overflow():
    got = key_metrics(np.array([1e300, 1e300]), np.array([1e300, 2e300]))
    assert got.nmse == pytest.approx(0.5) and got.max_rel_err == pytest.approx(1.0)


def test_integers_and_mismatched_buffers():
    got = m([1, 2], [1, 3], np.int8)
    assert got == KeyMetrics(0.2, 0.5, 1)
    assert key_metrics(np.zeros(3, f32), np.zeros(4, f32)) is UNCOMPARABLE
    assert key_metrics(np.zeros(3, f32), np.zeros(3, np.float64)) is UNCOMPARABLE


# ---- classification thresholds -------------------------------------------

def test_threshold_boundaries():
    t = 1e-7
    assert Tolerance().nmse == t and Tolerance().ulp is None and Tolerance().rel is None
    at, above = KeyMetrics(t, 0.0, 0), KeyMetrics(float(np.nextafter(t, 1.0)), 0.0, 0)
    assert Tolerance().holds(at) and not Tolerance().holds(above)
    assert Tolerance(nmse=None, ulp=4).holds(KeyMetrics(INF, INF, 4))  # only the named criterion counts
    assert not Tolerance(nmse=None, ulp=4).holds(KeyMetrics(0.0, 0.0, 5))
    assert Tolerance(nmse=None, rel=1e-3).holds(KeyMetrics(1.0, 1e-3, 99))
    assert not Tolerance(nmse=None, rel=1e-3).holds(KeyMetrics(0.0, float(np.nextafter(1e-3, 1.0)), 0))
    both = Tolerance(nmse=1e-7, ulp=4)
    assert both.holds(KeyMetrics(1e-7, 0.5, 4))
    assert not both.holds(KeyMetrics(1e-7, 0.5, 5)) and not both.holds(KeyMetrics(2e-7, 0.5, 4))


def test_threshold_on_arrays():
    ref, sub = np.array([1, 1, 1, 1], f32), np.array([1, 1, 1, 1.5], f32)  # nmse exactly 0.0625
    assert classify(Status.DIFF, ref, sub, Tolerance(nmse=0.0625))[0] == CLOSE
    assert classify(Status.DIFF, ref, sub, Tolerance(nmse=float(np.nextafter(0.0625, 0))))[0] == FAR
    assert classify(Status.DIFF, ref, sub, Tolerance(nmse=None, ulp=1 << 22))[0] == CLOSE
    assert classify(Status.DIFF, ref, sub, Tolerance(nmse=None, ulp=(1 << 22) - 1))[0] == FAR


def test_classify_ok_and_hash_only():
    a = np.array([1.0], f32)
    assert classify(Status.OK, a, a) == ("ok", None)
    assert classify(Status.DIFF, None, a) == ("DIFF", None)  # hash-only: stays DIFF
    assert classify(Status.DIFF, a, None) == ("DIFF", None)
    assert classify(Status.MISSING_SUB, a, None) == ("missing_sub", None)


# ---- spec parsing ----------------------------------------------------------

@pytest.mark.parametrize("spec, want", [
    ("nmse=1e-7", Tolerance()),
    ("default", Tolerance()),
    ("ulp=4", Tolerance(nmse=None, ulp=4)),
    ("rel=1e-3", Tolerance(nmse=None, rel=1e-3)),
    (" NMSE = 1e-5 , ulp=0,rel=0.5 ", Tolerance(nmse=1e-5, ulp=0, rel=0.5)),
])
def test_parse_ok(spec, want):
    got = parse_tolerance(spec)
    assert got == want
    assert parse_tolerance(got.spec()) == got


@pytest.mark.parametrize("spec, needle", [
    ("", "empty"),
    ("nmse", "'nmse' is not name=value"),
    ("nmse=", "'nmse=' is not name=value"),
    ("=1", "'=1' is not name=value"),
    ("nmse=1e-7,", "'' is not name=value"),
    ("foo=1", "unknown criterion 'foo'"),
    ("nmse=abc", "nmse='abc' is not a number"),
    ("nmse=-1", "nmse='-1' is below 0; nmse takes a number >= 0"),
    ("rel=nan", "rel='nan' is not finite; rel takes a number >= 0"),
    ("rel=inf", "rel='inf' is not finite"),
    ("rel=1e400", "rel='1e400' is not finite"),
    ("ulp=1.5", "ulp='1.5' is not a whole number"),
    ("ulp=-1", "ulp='-1' is below 0; ulp takes a whole number of ULPs >= 0"),
    ("nmse=1,nmse=2", "nmse given twice"),
])
def test_parse_errors(spec, needle):
    with pytest.raises(UsageError) as e:
        parse_tolerance(spec)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("--tol")


def test_cli_bad_tol_one_line_exit_2(capsys):
    assert main(["run", "--tokens", "2", "--tol", "ulp=x"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == ("kestrel-tui run: error: --tol 'ulp=x': ulp='x' is not a whole number; ulp"
                                         " takes a whole number of ULPs >= 0 (criteria: nmse=X, ulp=N or rel=X,"
                                         " comma-combined, e.g. nmse=1e-7,ulp=4)")


# ---- end to end: cpu vs sim all fast -----------------------------------------

BASE = ["run", "--subject", "sim", "--exact", "none", "--tokens", "2"]


def run(capsys, *argv):
    code = main([*BASE, *argv])
    out, err = capsys.readouterr()
    return code, out


def test_json_fields_consistent(capsys):
    code, out = run(capsys, "--tol", "nmse=1e-7", "--json")
    r = json.loads(out)
    assert r["tolerance"] == "nmse=1e-07"
    counts, km = r["counts_close_far"], r["key_metrics"]
    assert counts["unjudged"] == 0 and counts["close"] + counts["far"] == r["counts"]["DIFF"] == len(km)
    assert counts["far"] > 0 and code == 1
    assert all(set(v) == {"nmse", "max_rel_err", "max_ulp", "verdict", "rule"} for v in km.values())
    far = [k for k, v in km.items() if v["verdict"] == "far"]
    close = [k for k, v in km.items() if v["verdict"] == "close"]
    assert len(far) == counts["far"] and len(close) == counts["close"]
    assert all(float(km[k]["nmse"]) > 1e-7 for k in far) and all(float(km[k]["nmse"]) <= 1e-7 for k in close)
    assert r["first_far"] in far and r["first_far"] == min(far, key=order_key)
    assert order_key(r["first_far"]) >= order_key(r["first_diff"])
    # the rest of the report is the plain run's
    code0, out0 = run(capsys, "--json")
    r0 = json.loads(out0)
    assert code0 == 1 and {k: r[k] for k in r0} == r0


def test_huge_tolerance_exit_0(capsys):
    # nmse=1 is not enough here: by layer 46 the all-fast K/V rows are as good as uncorrelated (nmse ~1.01)
    code, out = run(capsys, "--tol", "nmse=10", "--json")
    r = json.loads(out)
    assert code == 0 and r["first_far"] is None and r["counts_close_far"]["far"] == 0
    assert r["all_ok"] is False and r["first_diff"] is not None  # DIFF keys, all close
    code, out = run(capsys, "--tol", "nmse=10")
    assert code == 0 and "first far: none" in out and "0 far" in out


def test_text_output(capsys):
    code0, plain = run(capsys)
    assert code0 == 1 and "first far" not in plain and "tolerance" not in plain
    code, out = run(capsys, "--tol", "nmse=1e-7")
    assert code == 1
    lines = out.splitlines()
    i = next(n for n, l in enumerate(lines) if l.startswith("first DIFF: "))
    far = next(n for n, l in enumerate(lines) if l.startswith("first far: "))
    assert far in (i + 1, i + 2)  # right after the first DIFF (and its element statistics)
    assert "nmse " in lines[far] and "max rel " in lines[far] and "max ULP " in lines[far]
    assert lines[far + 1].startswith("tolerance nmse=1e-07: ") and " close, " in lines[far + 1]
    # with the extra lines removed (and the event the first far key follows), the output is the plain run's
    after = [n for n, l in enumerate(lines) if l.startswith("  after: ")]
    assert after in ([], [far + 2])
    assert [l for n, l in enumerate(lines) if n not in (far, far + 1, *after)] == plain.splitlines()


# ---- RunResult.tolerance ------------------------------------------------------

def test_run_result_tolerance_lazy_and_hash_only(small_model):
    from kestrel_tui.session.session import RunSettings, Session

    res = Session(small_model, [1, 2, 3, 4], 2).run(RunSettings())
    diff = [k for k, st in res.comparison.status.items() if st is Status.DIFF]
    assert diff and not res._metrics
    s = res.tolerance(Tolerance(nmse=1e-7))
    assert set(res._metrics) == set(diff)  # DIFF keys only
    assert list(s.verdict) == diff  # dataflow order
    assert s.n_close + s.n_far == len(diff) and s.n_unjudged == 0 and s.n_missing == 0
    far = [k for k in diff if s.verdict[k] == FAR]
    assert s.first_far == (min(far, key=order_key) if far else None)
    assert s.all_close == (not far)
    loose = res.tolerance(Tolerance(nmse=10.0))
    assert loose.n_far == 0 and loose.all_close and loose.metrics == s.metrics  # metrics reused
    # a DIFF key without the subject's raw buffer stays DIFF: not judged, and not "all close"
    key = diff[0]
    res.sub.positions[int(key[1:key.index("_")])].raw.pop(key)
    res._metrics.clear()
    res._summaries.clear()  # the cached judgements were made on the buffers just changed
    s = res.tolerance(Tolerance(nmse=10.0))
    assert key not in s.verdict and s.n_unjudged == 1 and not s.all_close


def test_bisect_target_far(capsys):
    code = main(["bisect", "--tokens", "2", "--target", "far", "--tol", "nmse=1e-7", "--json"])
    r = json.loads(capsys.readouterr()[0])
    assert code == 0 and r["all_ok"] and r["target"] == "far" and r["tolerance"] == "nmse=1e-07"
    assert r["moves"] and r["moves"][-1]["after"] is None and r["minimal"]
    # the minimal set really leaves no far key
    code, out = run(capsys, "--exact", ",".join(r["minimal"]), "--tol", "nmse=1e-7", "--json")
    assert code == 0 and json.loads(out)["first_far"] is None
    assert main(["bisect", "--tokens", "2", "--tol", "ulp=1"]) == 2
    assert "needs --target far" in capsys.readouterr()[1]

"""MismatchTally's histogram: its bins' edges (0 alone, the clip bands' edges, NaN, the infinities) and what
a tally of no token reports."""
import math

import numpy as np
import pytest

from kestrel_tui.trace.logprobs import CLIP_BANDS, EDGES, MismatchTally, bin_labels, bin_of


def label(x: float) -> str:
    return bin_labels()[int(bin_of(np.array([x]))[0])]


def below(x: float) -> float:
    return float(np.nextafter(x, -math.inf))


def test_zero_is_a_bin_of_its_own():
    assert label(0.0) == label(-0.0) == "= 0"
    assert label(float(np.nextafter(0.0, 1.0))) == "(0, 1e-06)"  # the smallest positive: not 0's bin
    assert label(below(0.0)) == "[-1e-06, 0)"


@pytest.mark.parametrize("value", sorted({v for band in CLIP_BANDS for v in band}))
def test_each_clip_band_edge_starts_a_bin(value):
    edge = math.log(value)
    shown = f"{edge:.3g}"
    assert label(edge).startswith(f"[{shown},")
    assert label(below(edge)).endswith(f", {shown})")
    assert bin_of(np.array([edge]))[0] == bin_of(np.array([below(edge)]))[0] + 1


def test_nan_and_the_infinities_have_their_bins():
    assert label(math.nan) == "NaN"
    assert label(math.inf) == ">= 1" == label(1.0)
    assert label(-math.inf) == "< -1" == label(below(-1.0))
    assert label(-1.0) == "[-1, -0.5)"


def test_bins_rise_by_one_at_every_edge_and_only_there():
    x = np.array(sorted({v for e in EDGES for v in (below(e), e, float(np.nextafter(e, math.inf)))}))
    bins = bin_of(x)
    assert (np.diff(bins) >= 0).all()
    assert len(set(bins.tolist())) == len(bin_labels()) - 1  # every bin but NaN's is reached
    for e in EDGES:
        step = int(bin_of(np.array([e]))[0] - bin_of(np.array([below(e)]))[0])
        assert step == 1, e


def test_a_tally_of_no_token_reports_none_not_zero():
    f = MismatchTally().figures()
    assert f["tokens"] == 0 and f["k1"] is None and f["max_abs_dp"] is None
    assert f["seq_geo_ratio_min"] is None and f["worst"] is None


def test_a_subject_probability_of_zero_is_an_infinite_kl_outside_every_band():
    t = MismatchTally()
    t.add([-0.5, -1.0], [-0.5, -math.inf])
    f = t.figures()
    assert f["k1"] == math.inf and f["k3"] == math.inf
    assert all(f[f"outside_{lo:g}_{hi:g}"] == 0.5 for lo, hi in CLIP_BANDS)
    assert f["histogram"]["< -1"] == 1 and f["histogram"]["= 0"] == 1
    assert f["worst"] == {"sequence": 0, "token": 1, "abs_log_ratio": math.inf}

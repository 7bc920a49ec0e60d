"""q8_0 activation codes of a q4_0 GEMV's input: where a 1-ULP difference flips a code, and the
detail panel's line for it."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kestrel_tui.app.widgets.detail import key_info
from kestrel_tui.model.quant import QK, _inverse, _roundf, q8_0_code_flips
from kestrel_tui.trace.compare import Status


def _crossing(seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A block and a copy with one element moved by one ULP across a .5 rounding boundary."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(2 * QK).astype(np.float32)
    x[0] = np.float32(4)  # the block's max, left alone: the scale stays put
    j = 1 + int(rng.integers(QK - 2))
    inv = _inverse(np.abs(x[:QK]).max() / np.float32(127))
    sign = np.float32(1 if x[j] > 0 else -1)
    v = np.float32(np.float32(int(abs(x[j]) * inv) + 0.5) / inv)  # |v| near a .5 boundary
    for _ in range(16):
        v = np.nextafter(v, np.float32(0))  # start below it
    while _roundf(v * inv) == _roundf(np.nextafter(v, np.float32(np.inf)) * inv):
        v = np.nextafter(v, np.float32(np.inf))
    up = np.nextafter(v, np.float32(np.inf))
    v, up = v * sign, up * sign
    a, b = x.copy(), x.copy()
    a[j], b[j] = v, up
    return a, b, j


def test_equal_activations_have_equal_codes():
    x = np.random.default_rng(0).standard_normal(4 * QK).astype(np.float32)
    assert q8_0_code_flips(x, x.copy()) is None


def test_one_ulp_across_a_boundary_flips_one_code():
    for seed in range(50):
        a, b, j = _crossing(seed)
        assert (a.view(np.uint32) != b.view(np.uint32)).sum() == 1
        f = q8_0_code_flips(a, b)
        assert f is not None and (f.n, f.n_blocks, f.index) == (1, 1, j)
        assert abs(f.codes[0] - f.codes[1]) == 1
        lo, hi = sorted(f.scaled, key=abs)
        assert abs(lo) % 1 < 0.5 + 1e-3 and abs(hi) % 1 > 0.5 - 1e-3  # the two sides of the boundary


def test_detail_names_the_flipped_input_code():
    a, b, j = _crossing(7)
    raws_ref = {"t5_l0_attn": a, "t5_l0_ores": np.ones(4, np.float32)}
    raws_sub = {"t5_l0_attn": b, "t5_l0_ores": np.full(4, 2, np.float32)}
    board = SimpleNamespace(cell=lambda k, t: Status.DIFF, hashes=lambda k: (1, 2), first_diff="t5_l0_ores",
                            sides=("ref", "sub"), tolerance=None, live=True, q8_inputs=True,
                            raw_ref=raws_ref.get, raw_sub=raws_sub.get)
    info = key_info(board, "t5_l0_ores", 5)
    assert info.q8_input == "t5_l0_attn" and info.q8 is not None and info.q8.index == j
    board.q8_inputs = False  # f32 weights: no q8_0 activations to look at
    assert key_info(board, "t5_l0_ores", 5).q8_input is None

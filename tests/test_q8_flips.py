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


def _board(attn_ref: np.ndarray, attn_sub: np.ndarray) -> SimpleNamespace:
    """A board whose t5_l0_ores is a DIFF key fed by the two sides' t5_l0_attn (its q8_0 input)."""
    raws_ref = {"t5_l0_attn": attn_ref, "t5_l0_ores": np.ones(4, np.float32)}
    raws_sub = {"t5_l0_attn": attn_sub, "t5_l0_ores": np.full(4, 2, np.float32)}
    return SimpleNamespace(cell=lambda k, t: Status.DIFF, hashes=lambda k: (1, 2), first_diff="t5_l0_ores",
                           sides=("ref", "sub"), tolerance=None, live=True, q8_inputs=True,
                           raw_ref=raws_ref.get, raw_sub=raws_sub.get)


def test_detail_names_the_flipped_input_code():
    a, b, j = _crossing(7)
    board = _board(a, b)
    info = key_info(board, "t5_l0_ores", 5)
    assert info.q8_input == "t5_l0_attn" and info.q8 is not None and info.q8.index == j
    board.q8_inputs = False  # f32 weights: no q8_0 activations to look at
    assert key_info(board, "t5_l0_ores", 5).q8_input is None


def _scale_step(seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Two blocks of activations whose codes are all equal but whose block `b` max differs by one
    ULP, just across an f16 rounding boundary of its scale (max/127): the scale moves one f16 step."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(2 * QK).astype(np.float32)
    b = int(rng.integers(2))
    j = b * QK + int(rng.integers(QK))
    m = np.float32(rng.uniform(2, 3))
    while True:  # walk the max up until one ULP more moves its f16 scale
        up = np.nextafter(m, np.float32(np.inf))
        if np.float16(m / np.float32(127)) != np.float16(up / np.float32(127)):
            break
        m = np.float32(m + np.float32(rng.uniform(0, 1e-4)))
    x[b * QK:(b + 1) * QK] = np.clip(x[b * QK:(b + 1) * QK], -1.9, 1.9)
    a, c = x.copy(), x.copy()
    a[j], c[j] = m, up
    return a, c, b


def test_a_block_scale_one_f16_step_apart_is_named_with_codes_equal():
    seen = 0
    for seed in range(200):
        a, c, b = _scale_step(seed)
        f = q8_0_code_flips(a, c)
        assert f is not None and f.n_scales == 1 and f.scale_block == b and f.scale_steps == 1
        assert np.float16(f.scales[0]) != np.float16(f.scales[1])
        if f.index is None:  # the case a code line alone missed: every code equal
            seen += 1
            assert f.n == 0
    assert seen > 100


def test_detail_names_a_differing_block_scale():
    from kestrel_tui.app.widgets.detail import DetailPanel

    a, c, b = next(t for t in map(_scale_step, range(50)) if q8_0_code_flips(t[0], t[1]).index is None)
    board = _board(a, c)
    info = key_info(board, "t5_l0_ores", 5)
    panel = DetailPanel()
    panel.style_of = lambda name: ""  # no app, no styles: the words are what is checked
    line = str(panel._q8_line(info))
    assert "codes equal" in line and f"1 block scale differs, block {b}:" in line and "(1 f16 step)" in line
    assert "the sums differ" not in line

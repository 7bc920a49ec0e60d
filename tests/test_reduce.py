"""The vectorised ordered reductions equal a literal scalar transcription of the contract."""
import numpy as np
import pytest

from kestrel_tui.numerics.reduce import lane_sum, seq_sum, sumsq_block8

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # wide-exponent samples overflow on purpose

F32 = np.float32


def lane_sum_scalar(t):
    lanes = [F32(0)] * 32
    for i, x in enumerate(t):
        lanes[i % 32] = F32(lanes[i % 32] + x)
    for off in (16, 8, 4, 2, 1):
        lanes = [F32(lanes[i] + lanes[i ^ off]) for i in range(32)]
    return lanes[0]


def sumsq_block8_scalar(x):
    ss = F32(0)
    n8 = len(x) & ~7
    for b in range(0, n8, 8):
        lo = [F32(x[b + k] * x[b + k]) for k in range(4)]
        hi = [F32(x[b + 4 + k] * x[b + 4 + k]) for k in range(4)]
        lo = [F32(lo[k] + hi[k]) for k in range(4)]
        ss = F32(ss + F32(F32(lo[0] + lo[1]) + F32(lo[2] + lo[3])))
    for j in range(n8, len(x)):
        ss = F32(ss + F32(x[j] * x[j]))
    return ss


def seq_sum_scalar(t):
    s = F32(0)
    for x in t:
        s = F32(s + x)
    return s


def _samples(rng, n):
    kind = rng.integers(4)
    if kind == 0:
        x = rng.standard_normal(n)
    elif kind == 1:
        x = rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)  # wide exponents: rounding matters
    elif kind == 2:
        x = np.where(rng.random(n) < 0.3, 0.0, rng.standard_normal(n)) * rng.choice([-1, 1], n)
        x[rng.random(n) < 0.2] = -0.0
    else:
        x = rng.uniform(-1, 1, n) + 1e7 * (rng.random(n) < 0.05)  # cancellation
    return x.astype(F32)


@pytest.mark.parametrize("n", [1, 7, 8, 31, 32, 33, 64, 100, 256, 2048 // 32, 777])
def test_reductions_bit_exact(n):
    rng = np.random.default_rng()
    for _ in range(30):
        rows = np.stack([_samples(rng, n) for _ in range(4)])
        got_lane = lane_sum(rows, axis=-1)
        got_sq = sumsq_block8(rows)
        got_seq = seq_sum(rows)
        for r in range(4):
            assert got_lane[r].view(np.uint32) == lane_sum_scalar(rows[r]).view(np.uint32)
            assert got_sq[r].view(np.uint32) == sumsq_block8_scalar(rows[r]).view(np.uint32)
            assert got_seq[r].view(np.uint32) == seq_sum_scalar(rows[r]).view(np.uint32)


def test_lane_sum_other_axis_and_negative_zero():
    t = np.full((40, 3), -0.0, F32)
    assert (lane_sum(t, axis=0).view(np.uint32) == 0).all()  # +0, as a GPU lane starting at +0 gives
    assert seq_sum(t.T).view(np.uint32).tolist() == [0, 0, 0]

"""The compiled reference's quantizers and GEMVs (kestrel_tui/cref quant.c, gemv.c) against numpy's,
bit for bit, at every SIMD level this CPU has (kc_gemv_simd) and with 1 and 2 threads."""
from __future__ import annotations

import numpy as np
import pytest

from kestrel_tui.cref import Job
from kestrel_tui.model.quant import quantize_q4_0_ggml, quantize_q8_0, quantize_rows_q8
from kestrel_tui.model.weights import Linear
from kestrel_tui.numerics.linalg import f32_gemv, q4_gemv

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # subnormal / huge samples, on purpose

F32 = np.float32
THREADS = (1, 2)


@pytest.fixture(scope="module")
def levels(cref):
    """Every SIMD level of kc_gemv_simd that this CPU runs (0 = scalar first); the best one is put back."""
    top = cref.kc_gemv_simd(99)
    assert 0 <= top == cref.kc_gemv_simd(-1)
    yield list(range(top + 1))
    cref.kc_gemv_simd(top)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=F32).view(np.uint32)


def assert_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, what
    bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
    if bad.size:
        i = bad[0]
        pytest.fail(f"{what}: {bad.size} of {g.size} outputs differ; first at {np.unravel_index(i, g.shape)}:"
                    f" {got.reshape(-1)[i]!r} ({g.reshape(-1)[i]:#010x}) != {want.reshape(-1)[i]!r}"
                    f" ({w.reshape(-1)[i]:#010x})")


def c_jobs(specs: list[dict]):
    """(Job * n) from dicts of w (array), out, n, xrow/yrow (int64 arrays or None), y_off; the index arrays
    are kept alive with the jobs."""
    jobs = (Job * len(specs))()
    keep = []
    for j, s in zip(jobs, specs):
        j.w, j.out, j.n, j.y_off = s["w"].ctypes.data, s["out"], s["n"], s.get("y_off", 0)
        for name in ("xrow", "yrow"):
            idx = s.get(name)
            if idx is not None:
                idx = np.ascontiguousarray(idx, dtype=np.int64)
                keep.append(idx)
                setattr(j, name, idx.ctypes.data)
    return jobs, keep


def run_q4(cref, specs, nb, qx, dx, y_shape, threads):
    y = np.full(y_shape, np.nan, F32)  # an output never written stays NaN and fails the comparison
    jobs, _keep = c_jobs(specs)
    cref.kc_gemv_q4(jobs, len(specs), nb, qx.ctypes.data, dx.ctypes.data, y.ctypes.data, y_shape[-1], threads)
    return y


def run_f32(cref, specs, inp, x, y_shape, threads):
    y = np.full(y_shape, np.nan, F32)
    jobs, _keep = c_jobs(specs)
    cref.kc_gemv_f32(jobs, len(specs), inp, x.ctypes.data, y.ctypes.data, y_shape[-1], threads)
    return y


@pytest.fixture(autouse=True)
def shared(cref):
    """Every op of two or more tiles shared by the team (by default small ones run on the caller alone),
    so the 2-thread runs below really split their rows."""
    cref.kc_team_share_min(0)
    yield
    cref.kc_team_share_min(-1)


def every_path(cref, levels, fn, want, what):
    for lv in levels:
        assert cref.kc_gemv_simd(lv) == lv
        for t in THREADS:
            assert_bits(fn(t), want, f"{what}, level {lv}, {t} threads")


# ---------------------------------------------------------------- inputs


def activations(rng, shape) -> np.ndarray:
    """f32 rows whose 32-blocks span many binades (so q8_0 scales from f16 subnormals to large), with
    all-zero, -0, one-nonzero and saturating blocks mixed in."""
    x = rng.standard_normal(shape).astype(F32)
    b = x.reshape(-1, 32)
    b *= (10.0 ** rng.uniform(-9, 4, (b.shape[0], 1))).astype(F32)
    n = b.shape[0]
    pick = rng.permutation(n)
    b[pick[: n // 16]] = 0
    b[pick[n // 16: n // 12]] = F32(-0.0)
    one = pick[n // 12: n // 8]
    b[one] = 0
    b[one, rng.integers(0, 32, one.size)] = rng.standard_normal(one.size).astype(F32)
    big = pick[n // 8: n // 6]
    b[big] = np.where(rng.random((big.size, 32)) < 0.5, F32(-1), F32(1)) * F32(3e4)  # q = +-127 everywhere
    return x


def q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """(qx int8 [rows, n], dx f32 [rows, nb], numpy's xq) of activations [..., n]."""
    qs, d = quantize_q8_0(x)
    n = x.shape[-1]
    return (np.ascontiguousarray(qs.reshape(-1, n)), np.ascontiguousarray(d.reshape(-1, n // 32)),
            (qs.astype(F32), d))


def finite_f16(rng, shape) -> np.ndarray:
    """Random finite f16 bit patterns: every binade, subnormals, both zeros (about 3% each)."""
    h = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    h = np.where((h & 0x7C00) == 0x7C00, h & 0x83FF, h)  # inf/NaN exponent -> subnormal
    r = rng.random(shape)
    h[r < 0.03] = 0
    h[(r >= 0.03) & (r < 0.06)] = 0x8000
    return h.astype(np.uint16)


def raw_blocks(rng, lead, nb) -> np.ndarray:
    """q4_0 blocks of random nibble bytes and random finite f16 scales."""
    blocks = rng.integers(0, 256, (*lead, nb, 18), dtype=np.uint8)
    blocks[..., :2] = finite_f16(rng, (*lead, nb))[..., None].view(np.uint8)
    return blocks


def real_blocks(rng, lead, inp) -> np.ndarray:
    w = rng.standard_normal((*lead, inp)).astype(F32)
    w *= (10.0 ** rng.uniform(-3, 1, (*lead, 1))).astype(F32)
    return quantize_q4_0_ggml(w)


# ---------------------------------------------------------------- level switch


def test_simd_levels(cref, levels):
    top = levels[-1]
    assert cref.kc_gemv_simd(0) == 0
    assert cref.kc_gemv_simd(-1) == 0
    assert cref.kc_gemv_simd(top + 5) == top  # never above what the CPU has
    assert cref.kc_gemv_simd(-1) == top


# ---------------------------------------------------------------- q4_0 block dots


@pytest.mark.parametrize("kind,rows,cols", [("quantized", 1000, 1000), ("raw", 1000, 1000),
                                            ("quantized", 500_000, 2), ("raw", 1_000_000, 2)])
def test_q4_block_dots(cref, levels, kind, rows, cols):
    """10^6 or more single-block dots (nb = 1: y = +0 + term): every weight row against every activation
    column (many of each, or 10^6 fresh weight blocks), against numpy's q4_gemv and against the contract
    written out directly."""
    rng = np.random.default_rng(rows + cols + (kind == "raw"))
    blocks = real_blocks(rng, (rows,), 32) if kind == "quantized" else raw_blocks(rng, (rows,), 1)
    qx, dx, xq = q8(activations(rng, (cols, 32)))
    want = q4_gemv((Linear(rows, 32, blocks=blocks),), xq)

    nib = blocks[:, 0, 2:]
    qw = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.int64) - 8  # [rows, 32]
    isum = qx.astype(np.int64) @ qw.T  # [cols, rows], exact
    dw = blocks[:, 0, :2].copy().view(np.float16)[:, 0].astype(F32)
    direct = F32(0) + isum.astype(F32) * (dw[None, :] * dx[:, :1])
    assert_bits(want, direct, "numpy q4_gemv vs the contract")

    spec = [{"w": blocks, "out": rows, "n": cols}]
    every_path(cref, levels, lambda t: run_q4(cref, spec, 1, qx, dx, (cols, rows), t), want, f"{kind} block dots")


# ---------------------------------------------------------------- q4_0 GEMV shapes

# nb 1, 2 and 4 pack 8/nb rows in one 8-block group; every other nb not a multiple of 8 reads its last group
# in place (masked) but for the last row, whose group is copied to a padded buffer
Q4_SHAPES = [(nb, m) for nb in (1, 2, 3, 4, 5, 6, 7, 8, 24, 31, 32, 33, 64, 96, 100) for m in (1, 2, 3, 5, 8)] + [
    (7, 40), (33, 40), (64, 40), (100, 4), (100, 6), (100, 7)]


@pytest.mark.parametrize("nb,m", Q4_SHAPES)
def test_q4_shapes(cref, levels, nb, m):
    rng = np.random.default_rng(nb * 100 + m)
    out = 37  # not a multiple of the row tiles
    blocks = real_blocks(rng, (out,), nb * 32) if m % 2 else raw_blocks(rng, (out,), nb)
    qx, dx, xq = q8(activations(rng, (m, nb * 32)))
    want = q4_gemv((Linear(out, nb * 32, blocks=blocks),), xq)
    spec = [{"w": blocks, "out": out, "n": m}]
    every_path(cref, levels, lambda t: run_q4(cref, spec, nb, qx, dx, (m, out), t), want, f"nb {nb}, M {m}")


@pytest.mark.parametrize("inp,out,m", [(2048, 512, 1), (2048, 300, 40), (768, 1024, 3), (4096, 64, 2)])
def test_q4_real_dims(cref, levels, inp, out, m):
    rng = np.random.default_rng(inp + out + m)
    blocks = real_blocks(rng, (out,), inp)
    qx, dx, xq = q8(activations(rng, (m, inp)))
    want = q4_gemv((Linear(out, inp, blocks=blocks),), xq)
    spec = [{"w": blocks, "out": out, "n": m}]
    every_path(cref, levels, lambda t: run_q4(cref, spec, inp // 32, qx, dx, (m, out), t), want,
               f"{inp}->{out}, M {m}")


def test_q4_lm_head(cref, levels):
    """A vocab-sized matrix (151936 rows of 2048): the row tiling at a real lm_head's size."""
    rng = np.random.default_rng(7)
    out, inp, m = 151936, 2048, 2
    blocks = raw_blocks(rng, (out,), inp // 32)
    qx, dx, xq = q8(activations(rng, (m, inp)))
    want = q4_gemv((Linear(out, inp, blocks=blocks),), xq)
    spec = [{"w": blocks, "out": out, "n": m}]
    for lv in levels:
        cref.kc_gemv_simd(lv)
        for t in (THREADS if lv else (2,)):  # the scalar path once: it is slow at this size
            assert_bits(run_q4(cref, spec, inp // 32, qx, dx, (m, out), t), want, f"lm_head, level {lv}, {t} threads")


@pytest.mark.parametrize("m", [1, 3, 40])
def test_q4_stacked(cref, levels, m):
    """q, k, v of one input side by side in one y row (y_off), as one call of three jobs."""
    rng = np.random.default_rng(11 + m)
    inp, outs = 2048, (128, 32, 48)
    parts = [Linear(o, inp, blocks=real_blocks(rng, (o,), inp)) for o in outs]
    qx, dx, xq = q8(activations(rng, (m, inp)))
    want = q4_gemv(tuple(parts), xq)
    offs = np.cumsum((0,) + outs)
    specs = [{"w": p.blocks, "out": p.out, "n": m, "y_off": int(o)} for p, o in zip(parts, offs)]
    every_path(cref, levels, lambda t: run_q4(cref, specs, inp // 32, qx, dx, (m, sum(outs)), t), want,
               f"stacked q/k/v, M {m}")


def expert_specs(stack: np.ndarray, expert: np.ndarray, per_slot: bool):
    """One job per selected expert: its columns are the (token, slot) pairs that chose it, in pair order;
    x row = the pair (per_slot) or the token, y row = the pair."""
    m, k = expert.shape
    specs = []
    for e in np.unique(expert):
        pairs = np.flatnonzero(expert.reshape(-1) == e)
        specs.append({"w": np.ascontiguousarray(stack[e]), "out": stack.shape[1], "n": len(pairs),
                      "xrow": pairs if per_slot else pairs // k, "yrow": pairs})
    return specs


@pytest.mark.parametrize("m,per_slot", [(1, False), (5, False), (5, True), (16, True)])
def test_q4_experts(cref, levels, m, per_slot):
    """An expert stack with top-k routing: xrow / yrow lists (gate/up read one x row per token, down one
    per slot)."""
    rng = np.random.default_rng(21 + m + per_slot)
    n_exp, k, inp, out = 8, 3, (768 if per_slot else 2048), (2048 if per_slot else 768)
    out //= 8  # a few rows keep the numpy side quick; the row tiling is exercised elsewhere
    stack = real_blocks(rng, (n_exp, out), inp)
    expert = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(m)])
    x = activations(rng, (m, k if per_slot else 1, inp))
    qx, dx, xq = q8(x)
    want = q4_gemv((Linear(out, inp, blocks=stack),), xq, expert=expert).reshape(m * k, out)
    specs = expert_specs(stack, expert, per_slot)
    every_path(cref, levels, lambda t: run_q4(cref, specs, inp // 32, qx, dx, (m * k, out), t), want,
               f"experts, M {m}, per_slot {per_slot}")


# ---------------------------------------------------------------- f32 GEMV


def f32_inputs(rng, shape) -> np.ndarray:
    x = rng.standard_normal(shape).astype(F32)
    x *= (10.0 ** rng.uniform(-6, 3, shape[:-1] + (1,))).astype(F32)
    x[..., rng.random(shape[-1]) < 0.05] = 0
    return x


@pytest.mark.parametrize("inp", [64, 65, 96, 100, 127, 200, 768, 1000, 2048])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_f32_shapes(cref, levels, inp, m):
    rng = np.random.default_rng(inp * 10 + m)
    out = 37
    w = f32_inputs(rng, (out, inp))
    x = f32_inputs(rng, (m, inp))
    want = f32_gemv((Linear(out, inp, w=w),), x)
    spec = [{"w": w, "out": out, "n": m}]
    every_path(cref, levels, lambda t: run_f32(cref, spec, inp, x, (m, out), t), want, f"f32 {inp}, M {m}")


def test_f32_small_inp(cref, levels):
    """inp below one 32-lane row (lanes left at +0) and a single element."""
    rng = np.random.default_rng(5)
    for inp in (1, 5, 31, 32, 33):
        w, x = f32_inputs(rng, (19, inp)), f32_inputs(rng, (2, inp))
        want = f32_gemv((Linear(19, inp, w=w),), x)
        spec = [{"w": w, "out": 19, "n": 2}]
        every_path(cref, levels, lambda t: run_f32(cref, spec, inp, x, (2, 19), t), want, f"f32 {inp}")


def test_f32_stacked_and_experts(cref, levels):
    rng = np.random.default_rng(9)
    inp, outs, m = 2048, (64, 16, 24), 4
    parts = [Linear(o, inp, w=f32_inputs(rng, (o, inp))) for o in outs]
    x = f32_inputs(rng, (m, inp))
    want = f32_gemv(tuple(parts), x)
    offs = np.cumsum((0,) + outs)
    specs = [{"w": p.w, "out": p.out, "n": m, "y_off": int(o)} for p, o in zip(parts, offs)]
    every_path(cref, levels, lambda t: run_f32(cref, specs, inp, x, (m, sum(outs)), t), want, "f32 stacked")

    n_exp, k, out = 6, 2, 40
    stack = f32_inputs(rng, (n_exp, out, inp))
    expert = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(m)])
    xe = f32_inputs(rng, (m, k, inp))
    want = f32_gemv((Linear(out, inp, w=stack),), xe, expert=expert).reshape(m * k, out)
    specs = expert_specs(stack, expert, per_slot=True)
    every_path(cref, levels, lambda t: run_f32(cref, specs, inp, xe, (m * k, out), t), want, "f32 experts")


# ---------------------------------------------------------------- quantizers and f16


def quant_inputs(rng, n_blocks: int) -> np.ndarray:
    """[n_blocks, 32] f32 blocks: wide magnitudes, all-zero, -0, one-nonzero, tiny (around the ~2.9e-39
    scale below which 1/d overflows), and blocks whose x*id hit k + 0.5 exactly."""
    b = rng.standard_normal((n_blocks, 32)).astype(F32)
    b *= (10.0 ** rng.uniform(-40, 37, (n_blocks, 1))).astype(F32)
    kinds = rng.integers(0, 8, n_blocks)
    b[kinds == 1] = 0
    b[kinds == 2] = F32(-0.0)
    one = np.flatnonzero(kinds == 3)
    b[one] = 0
    b[one, rng.integers(0, 32, one.size)] = rng.standard_normal(one.size).astype(F32)
    tiny = np.flatnonzero(kinds == 4)  # amax / 127 near 2.9e-39: both sides of the overflow of 1/d
    b[tiny] = rng.uniform(-1, 1, (tiny.size, 32)).astype(F32) * (F32(127 * 2.9e-39) * rng.uniform(
        0.5, 2, (tiny.size, 1)).astype(F32))
    half = np.flatnonzero(kinds == 5)  # amax = 127 * 2^e: d = 2^e, id = 2^-e, x*id = k + 0.5 exactly
    scale = (F32(2) ** rng.integers(-20, 20, (half.size, 1))).astype(F32)
    b[half] = (rng.integers(-127, 127, (half.size, 32)) + F32(0.5)) * scale
    b[half, 0] = F32(127) * scale[:, 0]
    return b


def test_quant_q8_0(cref, levels):
    rng = np.random.default_rng(31)
    x = quant_inputs(rng, 1 << 15).reshape(256, -1)  # 2^20 elements, rows of 4096
    rows, n = x.shape
    want_q, want_d = quantize_q8_0(x)
    for lv in levels:  # the quantizers' two builds (level 0, and KC_V3 from level 1 where the CPU has FMA)
        cref.kc_gemv_simd(lv)
        q = np.empty((rows, n), np.int8)
        d = np.empty((rows, n // 32), F32)
        cref.kc_quant_q8_0(x.ctypes.data, rows, n, q.ctypes.data, d.ctypes.data)
        assert np.array_equal(q, want_q.reshape(rows, n)), f"level {lv}"
        assert_bits(d, want_d, f"q8_0 scales, level {lv}")


@pytest.mark.parametrize("n", [32, 128, 100, 1])
def test_quant_rows_q8(cref, levels, n):
    rng = np.random.default_rng(41 + n)
    x = quant_inputs(rng, (1 << 20) // 32).reshape(-1)
    x = x[: x.size // n * n].reshape(-1, n)
    x = np.ascontiguousarray(x)
    x[::7] *= F32(1e-37)  # whole tiny rows, on both sides of the scale whose inverse overflows
    x[3::11] = 0
    rows = x.shape[0]
    want_q, want_d = quantize_rows_q8(x)
    for lv in levels:
        cref.kc_gemv_simd(lv)
        q = np.empty((rows, n), np.int8)
        d = np.empty(rows, F32)
        cref.kc_quant_rows_q8(x.ctypes.data, rows, n, q.ctypes.data, d.ctypes.data)
        assert np.array_equal(q, want_q), f"level {lv}"
        assert_bits(d, want_d, f"q8 row scales, level {lv}")


def test_f32_to_f16(cref):
    rng = np.random.default_rng(51)
    u = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    u = np.where((u & 0x7F800000) == 0x7F800000, u & 0x807FFFFF, u)  # finite: the contract's inputs
    # the f16 range densely (subnormals, the rounding of halfway cases, the overflow edge) and specials
    near = rng.integers(0x33000000, 0x47800000, 1 << 17, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 0x33000000, 0x33000001, 0x337FFFFF, 0x33800000, 0x387FC000, 0x387FE000,
                      0x387FFFFF, 0x38800000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x7F7FFFFF,
                      0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC02001, 0x7FE00000], np.uint32)
    # (quiet NaNs only: a float argument passes through Python's double, which would quiet a signalling one)
    # every rounding tie (the f32 halfway between two neighbouring f16s) and its two f32 neighbours
    h = np.arange(0x7BFF, dtype=np.uint16)
    lo, hi = h.view(np.float16).astype(np.float64), (h + 1).view(np.float16).astype(np.float64)
    ties = ((lo + hi) / 2).astype(F32).view(np.uint32)  # exact: 12 significant bits
    ties = np.concatenate([ties, ties - 1, ties + 1])
    u = np.concatenate([u, near, near | 0x80000000, ties, ties | 0x80000000, edges])
    f = u.view(F32)
    want = f.astype(np.float16).view(np.uint16)
    fn = cref.kc_f32_to_f16
    got = np.fromiter((fn(float(v)) for v in f), np.uint16, f.size)
    bad = np.flatnonzero(got != want)
    assert not bad.size, f"{bad.size} differ, first {u[bad[0]]:#010x}: {got[bad[0]]:#06x} != {want[bad[0]]:#06x}"


def test_f16_to_f32(cref):
    h = np.arange(1 << 16, dtype=np.uint16)
    want = h.view(np.float16).astype(F32).view(np.uint32)
    fn = cref.kc_f16_to_f32
    got = np.fromiter((fn(int(v)) for v in h), F32, h.size).view(np.uint32)
    nan = (h & 0x7C00 == 0x7C00) & (h & 0x3FF != 0)
    assert np.array_equal(got[~nan], want[~nan])
    # a NaN result passes through Python's double, which sets the quiet bit: sign and payload must survive
    assert np.array_equal(got[nan] | 0x00400000, want[nan] | 0x00400000)
    back = np.fromiter((cref.kc_f32_to_f16(float(v)) for v in got[~nan].view(F32)), np.uint16, int((~nan).sum()))
    assert np.array_equal(back, h[~nan])  # every f16 but NaN round-trips (inf and -0 included)

"""The reference cache: reused bit for bit, keyed by what determines the trace, never used corrupt,
bounded; the app says when its reference came from it."""
from __future__ import annotations

import numpy as np
import pytest

from kestrel_tui.session import refcache
from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.refcache import RefCache
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.model.hf import load_model


N = 3


@pytest.fixture(scope="module")
def model():
    return load_model(None, n_layers=2)


def session(model, cache, **kw):
    return Session(model, default_prompt(model.cfg.vocab, 4), kw.pop("n", N), subject="sim", cache=cache, **kw)


def same_trace(a, b):
    assert [p.token for p in a.positions] == [p.token for p in b.positions]
    for pa, pb in zip(a.positions, b.positions):
        assert pa.hashes == pb.hashes and list(pa.hashes) == list(pb.hashes)
        assert (pa.logits.view(np.uint32) == pb.logits.view(np.uint32)).all()
        for k in pa.raw:
            assert (np.asarray(pa.raw[k]).view(np.uint8) == np.asarray(pb.raw[k]).view(np.uint8)).all()


def test_second_session_reuses_the_reference_bit_for_bit(model, tmp_path):
    first = session(model, RefCache(tmp_path))
    computed = first.reference()
    assert not first.reference_cached and len(list(tmp_path.glob("*.npz"))) == 1
    second = session(model, RefCache(tmp_path))
    cached = second.reference()
    assert second.reference_cached
    same_trace(computed, cached)
    res = second.run(RunSettings(exact=frozenset(second.binary_toggles)))  # all exact: identical to cpu
    assert res.all_ok


def test_what_determines_the_trace_is_in_the_key(model, tmp_path, monkeypatch):
    session(model, RefCache(tmp_path)).reference()
    for kw in ({"n": N + 1}, {"kv": "f32"}, {"deep": True}):
        s = session(model, RefCache(tmp_path), **kw)
        s.reference()
        assert not s.reference_cached, kw
    other = load_model(None, "f32", n_layers=2)  # other weights, same shapes
    s = Session(other, default_prompt(model.cfg.vocab, 4), N, subject="sim", cache=RefCache(tmp_path))
    s.reference()
    assert not s.reference_cached
    monkeypatch.setattr(refcache, "CONTRACT_VERSION", refcache.CONTRACT_VERSION + 1)
    s = session(model, RefCache(tmp_path))
    s.reference()
    assert not s.reference_cached  # a changed contract never reuses an old entry


def test_a_corrupt_entry_is_dropped_with_a_note_and_recomputed(model, tmp_path):
    computed = session(model, RefCache(tmp_path)).reference()
    (entry,) = tmp_path.glob("*.npz")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    cache = RefCache(tmp_path)
    s = session(model, cache)
    same_trace(computed, s.reference())
    assert not s.reference_cached  # recomputed (and stored again, whole: its name is its checksum)
    (again,) = tmp_path.glob("*.npz")
    assert again.read_bytes() != bytes(data)
    assert len(cache.notes) == 1 and "corrupt" in cache.notes[0] and "\n" not in cache.notes[0]


def test_oldest_entries_go_past_the_size_limit(model, tmp_path):
    big = RefCache(tmp_path)
    session(model, big).reference()
    one = next(tmp_path.glob("*.npz")).stat().st_size
    small = RefCache(tmp_path, max_bytes=int(one * 3.5))  # room for three, each under half of it
    for n in (N + 1, N + 2, N + 3):
        session(model, small, n=n).reference()
    assert sum(p.stat().st_size for p in tmp_path.glob("*.npz")) <= small.max_bytes
    s = session(model, RefCache(tmp_path))
    s.reference()
    assert not s.reference_cached  # the oldest (the first) went


@pytest.mark.anyio
async def test_the_app_on_a_cached_reference_says_so_and_shows_the_grid_at_once(model, tmp_path, make_app, settle):
    session(model, RefCache(tmp_path / "cache")).reference()
    s = session(model, RefCache(tmp_path / "cache"))
    app = make_app(s, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert s.reference_cached
        header = app.main.query_one("#header").render()
        assert "cpu (cached) vs sim" in str(header)
        assert app.main.board.first_diff is not None  # the run went on against the cached reference


def test_every_weight_byte_is_in_the_fingerprint_large_arrays_too():
    """One byte flipped anywhere, in an array hashed on its own (1 MiB or more) or in a small one, moves
    the fingerprint; the same weights give the same one; two large arrays swapped move it too."""
    import dataclasses

    m = load_model(None, "f32", n_layers=2)
    base = refcache.model_fingerprint(m)
    assert refcache.model_fingerprint(load_model(None, "f32", n_layers=2)) == base
    arrays = [(name, a) for name, a in (("lm_head", m.lm_head.w), ("norm", m.norm)) if a is not None]
    assert arrays[0][1].nbytes >= refcache.ON_ITS_OWN > arrays[1][1].nbytes
    for name, a in arrays:
        flat = a.reshape(-1).view(np.uint8)
        for i in (0, flat.size // 2, flat.size - 1):
            flat[i] ^= 1
            assert refcache.model_fingerprint(m) != base, (name, i)
            flat[i] ^= 1
    assert refcache.model_fingerprint(m) == base
    L0, L1 = m.layers[0], m.layers[1]
    swapped = dataclasses.replace(m, layers=(dataclasses.replace(L0, up_proj=L1.up_proj),
                                             dataclasses.replace(L1, up_proj=L0.up_proj), *m.layers[2:]))
    assert L0.up_proj.w.nbytes >= refcache.ON_ITS_OWN and refcache.model_fingerprint(swapped) != base

"""A reference cache that cannot be used never breaks a run: its root a file, read-only or full, an
entry that is a folder or holds the wrong arrays under a right checksum — each is one `note:` line and
the run goes on, recomputing the reference or leaving it uncached."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kestrel_tui.session.inputs import default_prompt
from kestrel_tui.session.refcache import RefCache
from kestrel_tui.session.session import RunSettings, Session
from kestrel_tui.model.hf import load_model

from clitools import run_cli

ROOT = Path(__file__).resolve().parents[1]
N = 2
RUN = ("run", "--tokens", N, "--json")  # the embedded model: the reference is cached by default


@pytest.fixture(scope="module")
def model():
    return load_model(None, n_layers=2)


def session(model, cache, n: int = N):
    return Session(model, default_prompt(model.cfg.vocab, 4), n, subject="sim", cache=cache)


def notes(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [ln for ln in err.splitlines() if ln.startswith("note: reference cache")]


def cli_on_cache_root(capsys, monkeypatch, root: Path, *argv):
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    return run_cli(capsys, *(argv or RUN))


def entry_of(tmp_path: Path, model) -> Path:
    s = session(model, RefCache(tmp_path))
    s.reference()
    (entry,) = tmp_path.glob("*.npz")
    return entry


def rename_to_checksum(path: Path) -> Path:
    """The entry under the name the cache checks it against (a right checksum, whatever it holds)."""
    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    final = path.with_name(f"{path.stem.rsplit('-', 1)[0]}-{sha}.npz")
    path.rename(final)
    return final


@pytest.mark.parametrize("cmd", ["run", "bisect"])
def test_a_cache_root_that_is_a_file(capsys, monkeypatch, tmp_path, cmd):
    blocker = tmp_path / "xdg"
    blocker.write_text("not a folder")
    argv = RUN if cmd == "run" else ("bisect", "--tokens", N, "--json")
    code, out, err = cli_on_cache_root(capsys, monkeypatch, blocker, *argv)
    assert code in (0, 1), err
    json.loads(out)  # the report is whole
    (line,) = notes(err)
    assert "not a folder" in line and "not cached" in line and "--no-cache" in line
    assert blocker.read_text() == "not a folder"


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` made read-only for real: mode 0o500, or for root (whom modes do not stop) the
    immutable attribute; skipped where neither holds."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        try:
            yield
        finally:
            folder.chmod(0o700)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)],
                                                        capture_output=True).returncode != 0:
        pytest.skip("root ignores modes, and this filesystem has no immutable attribute")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_read_only_cache_root(capsys, monkeypatch, tmp_path):
    root = tmp_path / "xdg"
    folder = root / "kestrel-tui" / "reference"
    folder.mkdir(parents=True)
    with read_only(folder):
        code, out, err = cli_on_cache_root(capsys, monkeypatch, root)
        assert list(folder.iterdir()) == []
    assert code == 1 and json.loads(out)["first_diff"]
    (line,) = notes(err)
    assert "cannot write" in line and "not cached" in line


@pytest.mark.parametrize("where", ["mkstemp", "replace"])
def test_a_write_refused_midway_leaves_nothing_and_the_run_goes_on(model, tmp_path, monkeypatch, where):
    import errno
    import tempfile

    def refuse(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile if where == "mkstemp" else os, "mkstemp" if where == "mkstemp" else "replace",
                        refuse)
    cache = RefCache(tmp_path)
    s = session(model, cache)
    s.reference()
    monkeypatch.undo()
    assert s.run(RunSettings(exact=frozenset(s.binary_toggles))).all_ok
    assert len(cache.notes) == 1 and "Read-only file system" in cache.notes[0]
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


FULL = r"""
import os, resource, signal, sys
sys.path.insert(0, sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) like a full disk
from kestrel_tui.cli import main
from kestrel_tui.session import refcache
big = refcache.RefCache.store
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
def store(self, key, trace):
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # after the model loaded
    try:
        return big(self, key, trace)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
refcache.RefCache.store = store
sys.exit(main(["run", "--tokens", "2", "--json"]))
"""


def test_a_full_cache_disk(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", FULL, str(ROOT)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stderr
    json.loads(p.stdout)
    (line,) = notes(p.stderr)
    assert "cannot write" in line and "not cached" in line
    folder = tmp_path / "kestrel-tui" / "reference"
    assert list(folder.iterdir()) == []  # the unfinished entry is gone


def test_an_entry_that_is_a_folder(tmp_path, model):
    entry = entry_of(tmp_path / "kestrel-tui" / "reference", model)
    entry.unlink()
    entry.mkdir()
    (entry / "inside").write_text("x")
    s = session(model, RefCache(entry.parent))
    s.reference()
    assert not s.reference_cached
    assert entry.is_dir() and (entry / "inside").exists()  # not ours to remove
    assert len(s.cache.notes) == 1 and "is not a file" in s.cache.notes[0]
    assert s.run(RunSettings(exact=frozenset(s.binary_toggles))).all_ok


def test_an_entry_folder_in_the_way_of_pruning(model, tmp_path):
    entry = entry_of(tmp_path, model)
    blocker = tmp_path / ("0" * 32 + "-" + "0" * 16 + ".npz")  # the oldest: pruned first
    blocker.mkdir()
    os.utime(blocker, (0, 0))
    size = entry.stat().st_size
    session(model, RefCache(tmp_path), n=N + 1).reference()
    cache = RefCache(tmp_path, max_bytes=int(size * 3))  # the newest (8 positions to 6) under half of it
    session(model, cache, n=N + 2).reference()
    assert blocker.is_dir() and not entry.exists()  # the folder skipped, the next oldest entry pruned
    assert len(list(tmp_path.glob("*-*.npz"))) == 3 and cache.notes == []


@pytest.mark.anyio
async def test_the_app_on_a_cache_root_that_is_a_file_runs_and_says_so(model, tmp_path, make_app, settle):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    s = session(model, RefCache(blocker / "kestrel-tui" / "reference"))
    app = make_app(s, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert app.main.phase != "error"
        assert app.main.board.first_diff is not None  # the run went on, uncached
        shown = [n.message for n in app._notifications]
        assert any("reference cache" in m and "not cached" in m for m in shown), shown


def _rewrite(entry: Path, change) -> Path:
    with np.load(entry) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    entry.unlink()
    tmp = entry.with_name(entry.stem.rsplit("-", 1)[0] + "-0.npz")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return rename_to_checksum(tmp)


def _meta(arrays, **kw):
    meta = json.loads(bytes(arrays["meta"]).decode())
    meta.update(kw)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)


def _first_raw_spec(arrays, dtype=None, shape=None, offset=None):
    """Rewrite the first raw buffer's [dtype, shape, offset] in the entry's meta."""
    raw = json.loads(bytes(arrays["meta"]).decode())["raw"]
    spec = raw[0][0]
    spec[:] = [dtype or spec[0], spec[1] if shape is None else shape, spec[2] if offset is None else offset]
    _meta(arrays, raw=raw)


WRONG = {
    "no logits": lambda a: a.pop("logits"),
    "logits of float64": lambda a: a.update(logits=a["logits"].astype(np.float64)),
    "hashes cut short": lambda a: a.update(hashes=a["hashes"][:-3]),
    "tokens of one position fewer": lambda a: a.update(tokens=a["tokens"][:-1]),
    "a raw array missing": lambda a: a.pop(next(k for k in a if k.startswith("r"))),
    "raw bytes cut short": lambda a: a.update(raw=a["raw"][:-64]),
    "a raw buffer of objects": lambda a: _first_raw_spec(a, dtype="|O"),
    "a raw shape whose size wraps int64": lambda a: _first_raw_spec(a, shape=[2**62, 8]),
    "a raw offset past the bytes": lambda a: _first_raw_spec(a, offset=2**40),
    "a raw offset off its alignment": lambda a: _first_raw_spec(a, offset=4),
    "meta a list": lambda a: a.update(meta=np.frombuffer(b"[1, 2]", dtype=np.uint8)),
    "meta without keys": lambda a: _meta(a, keys=None),
    "another prompt": lambda a: _meta(a, prompt=[9, 9, 9, 9]),
    "one position fewer": lambda a: (_meta(a, keys=json.loads(bytes(a["meta"]).decode())["keys"][:-1],
                                           raw=json.loads(bytes(a["meta"]).decode())["raw"][:-1]),
                                     a.update(tokens=a["tokens"][:-1], logits=a["logits"][:-1])),
}


@pytest.mark.parametrize("what", list(WRONG))
def test_an_entry_with_a_right_checksum_and_the_wrong_arrays_is_recomputed(model, tmp_path, what):
    computed = session(model, RefCache(tmp_path)).reference()
    entry = _rewrite(next(tmp_path.glob("*.npz")), WRONG[what])
    cache = RefCache(tmp_path)
    s = session(model, cache)
    again = s.reference()
    assert not s.reference_cached, what
    assert [p.hashes for p in again.positions] == [p.hashes for p in computed.positions]
    assert len(cache.notes) == 1 and "corrupt entry" in cache.notes[0] and "\n" not in cache.notes[0]
    assert not entry.exists()  # dropped; the recomputed one stored in its place
    assert len(list(tmp_path.glob("*.npz"))) == 1

"""Reference traces on disk, keyed by everything that determines them.

The reference depends only on the model's content, the prompt, the token count, the KV
format, the probe set and the numerics contract's version; recomputing it is the first
wait of every session. An entry is one .npz file (hashes, consumed tokens, logits, raw
buffers) named ``<key>-<sha256 of the file>.npz``: written under a temporary name and
renamed whole, checked against its name before use — a corrupt entry is dropped with a
note and recomputed, never used. Oldest entries go first past the size limit. Only the
built-in cpu reference is cached: a foreign reference depends on library versions the
key cannot see.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ..numerics import CONTRACT_VERSION
from ..trace.rawstore import RawStore

FORMAT = 1                      # of the entry file itself
DEFAULT_MAX_BYTES = 4 * 2**30   # the cache's size limit


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kestrel-tui" / "reference"


def model_fingerprint(model) -> str:
    """blake2b of the model's config, format and every weight byte (walked field by field)."""
    h = hashlib.blake2b(digest_size=20)

    def walk(x):
        if isinstance(x, np.ndarray):
            a = np.ascontiguousarray(x)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(memoryview(a).cast("B"))
        elif isinstance(x, (np.generic, int, float, str, bool)) or x is None:
            h.update(repr(x).encode())
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                if f.name not in ("tokenizer", "notes", "name"):  # none of them changes a number
                    walk(getattr(x, f.name))
        else:
            h.update(repr(x).encode())

    walk(model)
    return h.hexdigest()


def trace_key(model_fp: str, prompt: list[int], n_tokens: int, kv: str, deep: bool, reference: str) -> str:
    what = {"contract": CONTRACT_VERSION, "format": FORMAT, "model": model_fp, "prompt": list(prompt),
            "n_tokens": n_tokens, "kv": kv, "deep": deep, "reference": reference}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


class RefCache:
    def __init__(self, folder: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.folder = Path(folder) if folder is not None else default_dir()
        self.max_bytes = max_bytes
        self.notes: list[str] = []  # one line per thing the user should know (a corrupt entry dropped)

    def _entries(self, key: str | None = None) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(self.folder.glob(f"{key or ''}*-*.npz"))

    def load(self, key: str):
        """The cached Trace for ``key``, or None (nothing there, or a corrupt entry: dropped, noted)."""
        from .run import Position, Trace

        for path in self._entries(key):
            want = path.stem.rsplit("-", 1)[1]
            store = RawStore()  # read once, kept like a computed trace's (spilled past its budget)
            try:
                if _sha256(path) != want:
                    raise ValueError("its checksum does not match")
                with np.load(path, allow_pickle=False) as z:
                    meta = json.loads(bytes(z["meta"]).decode())
                    hashes, tokens, logits = z["hashes"], z["tokens"], z["logits"]
                    trace = Trace(backend=meta["backend"], prompt=meta["prompt"], store=store)
                    P, i = len(meta["prompt"]), 0
                    for t, keys in enumerate(meta["keys"]):
                        n = len(keys)
                        raw = {k: z[m] for k, m in zip(keys, meta["raw"][t])} if meta["raw"][t] else None
                        trace.positions.append(Position(
                            t=t, token=int(tokens[t]), prompt=t < P, raw=store.keep(raw), logits=logits[t],
                            hashes={k: int(h) for k, h in zip(keys, hashes[i:i + n])}))
                        i += n
            except (OSError, ValueError, KeyError) as e:
                self.notes.append(f"reference cache: dropped a corrupt entry {path.name} ({e}); recomputing")
                path.unlink(missing_ok=True)
                continue
            os.utime(path)  # used: the last to be evicted
            return trace
        return None

    def store(self, key: str, trace) -> Path | None:
        """Write ``trace`` under ``key`` (whole or not at all); returns the entry, None when it is too big."""
        arrays, keys, raw_names = {}, [], []
        for p in trace.positions:
            keys.append(list(p.hashes))
            names = {}
            if p.raw is not None:
                for j, k in enumerate(p.raw):
                    names[k] = f"r{p.t}_{j}"
                    arrays[names[k]] = np.asarray(p.raw[k])
            raw_names.append([names[k] for k in p.hashes] if names else [])
        meta = {"backend": trace.backend, "prompt": list(trace.prompt), "keys": keys, "raw": raw_names}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        arrays["hashes"] = np.array([h for p in trace.positions for h in p.hashes.values()], dtype=np.uint64)
        arrays["tokens"] = np.array([p.token for p in trace.positions], dtype=np.int64)
        arrays["logits"] = np.stack([p.logits for p in trace.positions]).astype(np.float32)
        if sum(a.nbytes for a in arrays.values()) > self.max_bytes // 2:
            return None  # would push everything else out: not worth keeping
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}-", suffix=".tmp", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            final = self.folder / f"{key}-{_sha256(Path(tmp))}.npz"
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._evict(keep=final)
        return final

    def _evict(self, keep: Path) -> None:
        entries = sorted(self._entries(), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in entries)
        for p in entries:
            if total <= self.max_bytes:
                break
            if p != keep:
                total -= p.stat().st_size
                p.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]

"""Reference traces on disk, keyed by everything that determines them.

The reference depends only on the model's content, the prompt, the token count, the KV
format, the probe set and the numerics contract's version; recomputing it is the first
wait of every session. An entry is one .npz file (hashes, consumed tokens, logits, and the
raw buffers laid end to end in one array, so reading an entry is a few reads, not one a
key) named ``<key>-<sha256 of the file>.npz``: written under a temporary name and renamed
whole, checked against its name and its structure before use — a corrupt entry is dropped
with a note and recomputed, never used. A cache that cannot be read or written (its root a
file, read-only or full) is a note too, never a failed run. Oldest entries go first past
the size limit. Only the built-in cpu reference is cached: a foreign reference depends on
library versions the key cannot see.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import stat
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..numerics import CONTRACT_VERSION
from ..trace.rawstore import RawStore

FORMAT = 2                      # of the entry file itself (2: the raw buffers in one array)
ON_ITS_OWN = 1 << 20            # bytes: an array this large is hashed on its own (model_fingerprint)
RAW_ALIGN = 16                  # bytes: each raw buffer's offset in the entry's one raw array
DEFAULT_MAX_BYTES = 4 * 2**30   # the cache's size limit


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kestrel-tui" / "reference"


def model_fingerprint(model) -> str:
    """blake2b-160 of the model's config, format and every weight byte (walked field by field). An
    array of ON_ITS_OWN bytes or more enters as its own blake2b-160, those computed on every core
    (hashlib lets go of the GIL over a large buffer): a checkpoint of many GB is not read on one core
    each time a cached reference is looked up."""
    pieces: list = []  # bytes in walk order, or a large array standing for its digest

    def walk(x):
        if isinstance(x, np.ndarray):
            a = np.ascontiguousarray(x)
            pieces.append(f"{a.dtype.str}{a.shape}".encode())
            pieces.append(a if a.nbytes >= ON_ITS_OWN else memoryview(a).cast("B"))
        elif isinstance(x, (np.generic, int, float, str, bool)) or x is None:
            pieces.append(repr(x).encode())
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                if f.name not in ("tokenizer", "notes", "name"):  # none of them changes a number
                    walk(getattr(x, f.name))
        else:
            pieces.append(repr(x).encode())

    walk(model)
    large = [p for p in pieces if isinstance(p, np.ndarray)]
    digests = {}
    if large:
        with ThreadPoolExecutor(max_workers=min(len(large), os.cpu_count() or 1)) as pool:
            digests = dict(zip(map(id, large), pool.map(_digest, large)))
    h = hashlib.blake2b(digest_size=20)
    for p in pieces:
        h.update(digests[id(p)] if isinstance(p, np.ndarray) else p)
    return h.hexdigest()


def _digest(a: np.ndarray) -> bytes:
    return hashlib.blake2b(memoryview(a).cast("B"), digest_size=20).digest()


def trace_key(model_fp: str, prompt: list[int], n_tokens: int, kv: str, deep: bool, reference: str) -> str:
    what = {"contract": CONTRACT_VERSION, "format": FORMAT, "model": model_fp, "prompt": list(prompt),
            "n_tokens": n_tokens, "kv": kv, "deep": deep, "reference": reference}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


class RefCache:
    """Never a reason for a run to fail: whatever goes wrong reading or writing an entry (a root that
    is a file, read-only or full; an entry that is a folder or holds the wrong arrays) is one line in
    ``notes`` and the run goes on, recomputing the reference or leaving it uncached."""

    def __init__(self, folder: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.folder = Path(folder) if folder is not None else default_dir()
        self.max_bytes = max_bytes
        self.notes: list[str] = []  # one line per thing the user should know (a corrupt entry dropped)
        self._in_the_way: set[Path] = set()  # entries that are not files: noted once, never written over

    def _entries(self, key: str | None = None) -> list[Path]:
        try:
            if not self.folder.is_dir():
                return []
            return sorted(self.folder.glob(f"{key or ''}*-*.npz"))
        except OSError:  # an unreadable root reads as an empty cache; store() says what is wrong with it
            return []

    def load(self, key: str, prompt: list[int] | None = None, n_positions: int | None = None):
        """The cached Trace for ``key``, or None (nothing there, or an unusable entry: dropped, noted).
        ``prompt`` and ``n_positions``, when given, are what the entry must hold."""
        for path in self._entries(key):
            if not path.is_file():
                self.notes.append(f"reference cache: {path} is not a file; it is ignored and this reference"
                                  f" is not cached (remove it)")
                self._in_the_way.add(path)
                continue
            try:
                if _sha256(path) != path.stem.rsplit("-", 1)[1]:
                    raise ValueError("its checksum does not match")
                trace = _read_entry(path)
                if prompt is not None and trace.prompt != list(prompt):
                    raise ValueError("it holds another prompt")
                if n_positions is not None and len(trace.positions) != n_positions:
                    raise ValueError(f"it holds {len(trace.positions)} positions, not {n_positions}")
            except (OSError, ValueError, KeyError, IndexError, TypeError, EOFError, RecursionError,
                    zipfile.BadZipFile) as e:
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                self.notes.append(f"reference cache: dropped a corrupt entry {path.name} ({_line(why)});"
                                  f" recomputing")
                with contextlib.suppress(OSError):  # a read-only cache keeps it; the checksum refuses it again
                    path.unlink()
                continue
            with contextlib.suppress(OSError):  # a read-only cache still reads: only eviction order is lost
                os.utime(path)  # used: the last to be evicted
            return trace
        return None

    def store(self, key: str, trace) -> Path | None:
        """Write ``trace`` under ``key`` (whole or not at all); returns the entry, None when it is too big
        or cannot be written (noted: the run goes on, uncached)."""
        arrays, keys, raw_specs, parts, offset = {}, [], [], [], 0
        for p in trace.positions:
            keys.append(list(p.hashes))
            specs = []
            if p.raw is not None:
                for k in p.hashes:  # [dtype, shape, offset] a key, in the position's key order
                    a = np.ascontiguousarray(p.raw[k])
                    specs.append([a.dtype.str, list(a.shape), offset])
                    pad = -a.nbytes % RAW_ALIGN
                    parts += [a.reshape(-1).view(np.uint8), np.zeros(pad, np.uint8)]
                    offset += a.nbytes + pad
            raw_specs.append(specs)
        meta = {"backend": trace.backend, "prompt": list(trace.prompt), "keys": keys, "raw": raw_specs}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        arrays["hashes"] = np.array([h for p in trace.positions for h in p.hashes.values()], dtype=np.uint64)
        arrays["tokens"] = np.array([p.token for p in trace.positions], dtype=np.int64)
        arrays["logits"] = np.stack([p.logits for p in trace.positions]).astype(np.float32)
        if offset + sum(a.nbytes for a in arrays.values()) > self.max_bytes // 2:
            return None  # would push everything else out: not worth keeping
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}-", suffix=".tmp", dir=self.folder)
            with os.fdopen(fd, "wb") as f:
                _savez(f, arrays, raw=parts)
            final = self.folder / f"{key}-{_sha256(Path(tmp))}.npz"
            if final in self._in_the_way:
                return None  # already noted by load()
            os.replace(tmp, final)
            tmp = None
        except OSError as e:
            self.notes.append(f"reference cache: cannot write in {self.folder} ({_reason(e, self.folder)});"
                              f" this reference is not cached (fix or free that folder, set XDG_CACHE_HOME"
                              f" elsewhere, or pass --no-cache)")
            return None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self._evict(keep=final)
        return final

    def _evict(self, keep: Path) -> None:
        sized = []
        for p in self._entries():
            try:
                st = p.stat()
            except OSError:  # gone meanwhile (another kestrel-tui pruning)
                continue
            if stat.S_ISREG(st.st_mode):
                sized.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in sized)
        for _, size, p in sorted(sized, key=lambda x: x[0]):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                self.notes.append(f"reference cache: cannot remove {p.name} to stay under the size limit"
                                  f" ({_reason(e, self.folder)}); the cache stays larger")
                return
            total -= size


def _read_entry(path: Path):
    """An entry's Trace; ValueError/KeyError/IndexError/TypeError when its arrays are not a trace's."""
    from ..trace.run import Position, Trace

    store = RawStore()  # read once, kept like a computed trace's (spilled past its budget)
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(_array(z, "meta", np.uint8, 1)).decode())
        if not isinstance(meta, dict):
            raise ValueError("its meta is not an object")
        keys, raw_specs, prompt = meta["keys"], meta["raw"], meta["prompt"]
        if not (isinstance(keys, list) and isinstance(raw_specs, list) and len(raw_specs) == len(keys)
                and isinstance(prompt, list) and all(type(t) is int for t in prompt)
                and isinstance(meta["backend"], str)):
            raise ValueError("its meta does not describe a trace")
        n_keys = sum(len(k) for k in keys)
        hashes = _array(z, "hashes", np.uint64, 1, n_keys)
        tokens = _array(z, "tokens", np.int64, 1, len(keys))
        logits = _array(z, "logits", np.float32, 2, len(keys))
        blob = _array(z, "raw", np.uint8, 1)
        trace = Trace(backend=meta["backend"], prompt=prompt, store=store)
        P, i = len(prompt), 0
        for t, names in enumerate(keys):
            if not all(isinstance(k, str) for k in names) or not isinstance(raw_specs[t], list) \
                    or raw_specs[t] and len(raw_specs[t]) != len(names):
                raise ValueError(f"position {t} is malformed")
            raw = {k: _raw_view(blob, s) for k, s in zip(names, raw_specs[t])} if raw_specs[t] else None
            n = len(names)
            trace.positions.append(Position(
                t=t, token=int(tokens[t]), prompt=t < P, raw=store.keep(raw), logits=logits[t],
                hashes={k: int(h) for k, h in zip(names, hashes[i:i + n])}))
            i += n
    return trace


def _raw_view(blob: np.ndarray, spec) -> np.ndarray:
    """One raw buffer of an entry: [dtype, shape, offset] in its raw array (ValueError when it does not
    describe a numeric array inside it)."""
    dtype, shape, offset = spec
    dt = np.dtype(dtype)
    if dt.kind not in "biuf" or not isinstance(offset, int) or offset < 0 or offset % RAW_ALIGN \
            or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"a raw buffer described as {_line(repr(spec))}")
    count = math.prod(shape)  # exact: a hostile shape cannot wrap around
    if offset + count * dt.itemsize > blob.size:
        raise ValueError("a raw buffer runs past the entry's raw bytes")
    return np.frombuffer(blob, dt, count, offset).reshape(shape)


def _array(z, name: str, dtype, ndim: int, length: int | None = None) -> np.ndarray:
    a = z[name]
    if a.dtype != dtype or a.ndim != ndim or (length is not None and a.shape[0] != length):
        raise ValueError(f"its {name} array is {a.dtype}{list(a.shape)}, not a trace's")
    return a


def _reason(e: OSError, root: Path) -> str:
    if isinstance(e, (NotADirectoryError, FileExistsError)):
        return f"{e.filename or root} or a folder above it is not a folder"
    return e.strerror or str(e)


def _line(s: str) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= 200 else s[:199] + "…"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _savez(f, arrays: dict[str, np.ndarray], raw: list[np.ndarray]) -> None:
    """np.savez's file, its zip closed however writing ends: numpy 1.26's savez leaves the zip open on a
    full disk, and its later __del__ prints a traceback about a file closed meanwhile. `raw`: byte arrays
    written one after the other as the member raw.npy (uint8), never joined in memory."""
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as out:
                np.lib.format.write_array(out, np.asanyarray(a), allow_pickle=False)
        with z.open("raw.npy", "w", force_zip64=True) as out:
            np.lib.format.write_array_header_1_0(out, {"descr": "|u1", "fortran_order": False,
                                                       "shape": (sum(a.size for a in raw),)})
            for a in raw:
                out.write(memoryview(a))

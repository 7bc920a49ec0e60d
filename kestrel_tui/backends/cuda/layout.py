"""Where every buffer of an M-column step lives on the device, and the hash work list.

All buffers of a step live in one device allocation, the *arena*. Each probe
field (per layer, or emb/logits) is a region [M, *shape], its dtype and shape
the field registry's (trace/fields.py) — column m's buffer is
contiguous at offset + m*col_bytes — so the kernels write their outputs straight
into the buffers that get hashed and, when asked, copied back. Probe regions
come first (`key_bytes` is their end: a raw copy-back moves only those), then
the per-step scratch reused by every layer.

Isolate mode uploads the reference's buffers into a second arena with the
same layout, so an op's input pointer is simply taken from the other arena.

The hash work lists give each key to fnv_scan, a block a SCAN_MAX-byte segment (kernels/hash.cu);
their layout depends only on M (and deep).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...model.config import Config
from ...trace.fields import LAYER as LAYER_FIELDS
from ...trace.fields import TOKEN as TOKEN_FIELDS
from ...trace.keys import parse_key, token_keys
from .launches import SCAN_SEG, SCAN_THREADS

HASH_CHUNK = 4096  # must equal kernels/hash.cu HASH_CHUNK
HASH_PIECE = 256  # must equal kernels/hash.cu PIECE
FNV_PRIME = 0x100000001B3
SCAN_MAX = SCAN_THREADS * SCAN_SEG  # fnv_scan: a block a segment of this many bytes
HASH_SCAN_MAX = 1 << 40  # the backend's keys by fnv_scan: every key
# fnv_scan's powers of P: of its threads' SCAN_SEG bytes, and of a word count up to a thread's
SCAN_POW_SEG = np.array([pow(FNV_PRIME, SCAN_SEG * n, 1 << 64) for n in range(SCAN_THREADS)], np.uint64)
SCAN_POW_WORD = np.array([pow(FNV_PRIME, 4 * n, 1 << 64) for n in range(SCAN_SEG // 4 + 1)], np.uint64)
ALIGN = 256
F32, I8 = np.dtype(np.float32), np.dtype(np.int8)


class HashWork:
    """The work lists of kernels/hash.cu for byte spans (offset, nbytes), one hash per span, out[k]
    for span k: spans of up to `scan_max` bytes (0: none) for fnv_scan, cut into segments of
    SCAN_MAX bytes (a block each); the others cut into chunks for fnv_states + fnv_chunks (or
    fnv1a64_keys). Offsets must be multiples of 4."""

    def __init__(self, spans: list[tuple[int, int]], scan_max: int = 0):
        chunk_key, chunk_off, chunk_len, key_first, key_n = [], [], [], [], []
        seg_key, seg_off, seg_len, seg_first, seg_n, seg_after = [], [], [], [], [], []
        spans = [(int(start), int(nbytes)) for start, nbytes in spans]
        for k, (start, nbytes) in enumerate(spans):
            if start % 4 or nbytes % 4:
                raise ValueError(f"hash span ({start}, {nbytes}): offset and length must be multiples of 4")
            if scan_max and nbytes <= scan_max:
                n = max(1, -(-nbytes // SCAN_MAX))
                for q in range(n):
                    ln = min(SCAN_MAX, nbytes - q * SCAN_MAX)
                    seg_key.append(k)
                    seg_off.append(start + q * SCAN_MAX)
                    seg_len.append(ln)
                    seg_first.append(len(seg_key) - 1 - q)
                    seg_n.append(n)
                    seg_after.append(nbytes - q * SCAN_MAX - ln)
                key_first.append(0)
                key_n.append(0)
                continue
            n_chunks = max(1, -(-nbytes // HASH_CHUNK))
            key_first.append(len(chunk_key))
            key_n.append(n_chunks)
            for c in range(n_chunks):
                chunk_key.append(k)
                chunk_off.append(start + c * HASH_CHUNK)
                chunk_len.append(min(HASH_CHUNK, nbytes - c * HASH_CHUNK))
        pows = {n: pow(FNV_PRIME, n, 1 << 64) for n in set(chunk_len)}
        spow_cache = dict(pows)
        # per piece (HASH_PIECE bytes; chunk c's pieces are c*PIECES ...): P^len and P^(bytes
        # after the piece in its key), for fnv_chunks' closed-form fold
        per = HASH_CHUNK // HASH_PIECE
        piece_pow = np.zeros(len(chunk_key) * per, np.uint64)
        piece_spow = np.zeros(len(chunk_key) * per, np.uint64)
        for c, (k, ln) in enumerate(zip(chunk_key, chunk_len)):
            start, nbytes = spans[k]
            for j in range(per):
                plen = min(HASH_PIECE, ln - j * HASH_PIECE)
                if plen <= 0:
                    break
                end = chunk_off[c] + j * HASH_PIECE + plen
                after = start + nbytes - end
                for n in (plen, after):
                    if n not in spow_cache:
                        spow_cache[n] = pow(FNV_PRIME, n, 1 << 64)
                piece_pow[c * per + j] = spow_cache[plen]
                piece_spow[c * per + j] = spow_cache[after]
        self.piece_pow, self.piece_spow = piece_pow, piece_spow
        self.chunk_key = np.array(chunk_key, np.int32)
        self.chunk_off = np.array(chunk_off, np.uint64)
        self.chunk_len = np.array(chunk_len, np.int32)
        self.chunk_pow = np.array([pows[n] for n in chunk_len], np.uint64)
        self.key_first = np.array(key_first, np.int32)
        self.key_n = np.array(key_n, np.int32)
        self.n_chunks = len(chunk_key)
        self.n_keys = len(spans)
        self.seg_key = np.array(seg_key, np.int32)
        self.seg_off = np.array(seg_off, np.uint64)
        self.seg_len = np.array(seg_len, np.int32)
        self.seg_first = np.array(seg_first, np.int32)
        self.seg_n = np.array(seg_n, np.int32)
        after_pow = {n: pow(FNV_PRIME, n, 1 << 64) for n in set(seg_after)}
        self.seg_pow = np.array([after_pow[n] for n in seg_after], np.uint64)
        self.n_seg = len(seg_key)
        self.pow_seg = SCAN_POW_SEG
        self.pow_word = SCAN_POW_WORD

    ARRAYS = ("chunk_key", "chunk_off", "chunk_len", "chunk_pow", "key_first", "key_n", "piece_pow", "piece_spow",
              "seg_key", "seg_off", "seg_len", "seg_first", "seg_n", "seg_pow", "pow_seg", "pow_word")


@dataclass(frozen=True)
class Region:
    offset: int  # bytes from the arena base
    col_bytes: int  # one column's buffer
    dtype: np.dtype
    shape: tuple[int, ...]  # one column's shape (the cpu backend's buffer shape)


class Layout:
    def __init__(self, cfg: Config, kv: str, M: int, deep: bool):
        self.M = M
        self.regions: dict[tuple[str, int | None], Region] = {}
        self.total = 0
        h, hd, nkv, nh = cfg.hidden, cfg.head_dim, cfg.n_kv_heads, cfg.n_heads
        moe = cfg.is_moe
        add = self._add
        emb, logits = TOKEN_FIELDS
        # a dense layer's FFN adds its down GEMV straight into x: a dense model has no expert sum
        # to hold unless --deep hashes the MLP output under its name
        per_layer = [f for f in LAYER_FIELDS if moe or deep or f.name != "moe"]
        for f, li in [(emb, None), *((f, li) for li in range(cfg.n_layers) for f in per_layer), (logits, None)]:
            add(f.name, li, f.np_dtype(kv), f.shape(cfg, li))
        self.key_bytes = self.total
        # scratch, reused by every layer: the FFN's for the widest kind of layer the model has (the
        # sparse layers' k slots of an expert's width, the dense layers' one of intermediate_size)
        ffns = ([(cfg.top_k, cfg.moe_intermediate)] if moe else []) + ([(1, cfg.intermediate)] if cfg.has_dense else [])
        act = max(slots * width for slots, width in ffns)  # g, u, a: one column's activations
        max_in = max(h, nh * hd, *(width for _, width in ffns))
        for name, dt, n in (("q", F32, nh * hd), ("qn", F32, nh * hd), ("vraw", F32, nkv * hd),
                            ("xq", I8, max_in), ("xd", F32, max(1, max_in // 32)),
                            ("g", F32, act), ("u", F32, act), ("a", F32, act),
                            ("aq", I8, act), ("ad", F32, max(1, act // 32)), ("y", F32, (cfg.top_k if moe else 1) * h),
                            ("fnrm", F32, h), ("cos", F32, hd // 2), ("sin", F32, hd // 2)):
            add(name, None, dt, (n,))

        # hash work lists, columns in order, each column's keys in dataflow order; built on
        # first use (a prefill step that is not hashed never pays for them)
        names = token_keys(0, cfg.n_layers, deep)
        self.key_fields = [(k.field, k.layer) for k in map(parse_key, names)]
        self.key_suffixes = [name[len("t0_"):] for name in names]  # key of position t: f"t{t}_{suffix}"
        self.spans = []
        for m in range(M):
            for field, layer in self.key_fields:
                r = self.regions[field, layer]
                self.spans.append((r.offset + m * r.col_bytes, r.col_bytes))
        self.n_keys = len(self.spans)
        # the split for overlapped hashing: every key but the logits is final when the last
        # layer is done, so it is hashed while the final norm and lm_head run
        last = [i for i, kf in enumerate(self.key_fields * M) if kf[0] == "logits"]
        lset = set(last)
        self.body_index = np.array([i for i in range(self.n_keys) if i not in lset], np.int64)
        self.logits_index = np.array(last, np.int64)
        # hashes = concat(body_out, logits_out)[self.merge]
        order = np.concatenate([self.body_index, self.logits_index])
        self.merge = np.empty(self.n_keys, np.int64)
        self.merge[order] = np.arange(self.n_keys)
        self.merge_identity = bool((self.merge == np.arange(self.n_keys)).all())  # M=1: logits are last
        self._work: dict[str, HashWork] = {}

    def _hash_work(self, which: str) -> HashWork:
        w = self._work.get(which)
        if w is None:
            idx = {"body": self.body_index, "logits": self.logits_index}[which]
            w = self._work[which] = HashWork([self.spans[i] for i in idx], scan_max=HASH_SCAN_MAX)
        return w

    @property
    def hash_body(self) -> HashWork:
        """Every key but the logits (final once the last layer is done)."""
        return self._hash_work("body")

    @property
    def hash_logits(self) -> HashWork:
        return self._hash_work("logits")

    def _add(self, name: str, layer: int | None, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        col = int(np.prod(shape)) * dtype.itemsize
        if col % 4:
            raise ValueError(f"buffer {name} of {col} bytes: the device hash needs a multiple of 4")
        self.regions[name, layer] = Region(self.total, col, dtype, shape)
        self.total += -(-(self.M * col) // ALIGN) * ALIGN

    def offset(self, name: str, layer: int | None = None) -> int:
        return self.regions[name, layer].offset

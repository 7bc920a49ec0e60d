"""Per-rank folders of per-forward files: vLLM's tensor dump and SGLang's legacy tensor dump.

Both write, under the folder they are given, one folder per worker named
``TP{tp_rank}_PP{pp_rank}_Rank{rank}_pid{pid}`` holding ``Pass{NNNNN}.pt`` per forward: a dict of
module path -> output (a tuple output as a list of its tensors) of every leaf module, plus the
forward's token ids and positions under ``model.forward_batch_info.input_ids`` / ``.positions``
(SGLang adds ``.seq_lens``). The dump of a forward is written when the top-level ``model`` module
returns, so what runs after it — ``logits_processor`` — lands in the *next* forward's file: a
forward's logits are read from the file after it, and the last forward's are not in the dump.

Pipeline stages (PP > 1) hold disjoint layers: each TP rank's stages are merged into one dict.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ...errors import UsageError
from ...text import inert
from .load import index_vector, list_files, load_dict, refused
from .names import value_kind
from .steps import Forward, assemble_forward, logits_of

RANK_DIR = re.compile(r"TP(0|[1-9][0-9]{0,4})_PP(0|[1-9][0-9]{0,4})_Rank(0|[1-9][0-9]{0,5})_pid([0-9]{1,10})")
PASS_FILE = re.compile(r"Pass([0-9]{5,9})\.pt")
IDS, POSITIONS = "model.forward_batch_info.input_ids", "model.forward_batch_info.positions"
SEQ_LENS = "model.forward_batch_info.seq_lens"
_BATCH = {IDS: "ids", POSITIONS: "positions", SEQ_LENS: "ints"}


def kind_of(key: str, part: int | None) -> str | None:
    """What a pass file's entry must hold (load.check's kinds): the batch's ids and positions, or a module's
    output as names.py reads it."""
    return _BATCH[key] if key in _BATCH and part is None else value_kind(key, part)


def load_pass(path: Path) -> dict:
    return load_dict(path, kind_of)


class PassFolders:
    """The forwards of one run's rank folders; a forward's tensors are loaded only when asked for."""

    def __init__(self, folder: str | Path, engine: str, n_kv: int | None = None, n_layers: int | None = None):
        self.folder, self.engine, self.n_kv, self.n_layers = Path(folder), engine, n_kv, n_layers
        if not self.folder.is_dir():
            raise UsageError(f"{engine} dump {inert(str(folder))}: not a folder; name the folder the engine wrote"
                             f" (its TP*_PP*_Rank*_pid* folders inside)")
        dirs = list_files(self.folder, RANK_DIR, "dump folder")
        if not dirs:
            raise refused(self.folder, "has no TP<t>_PP<p>_Rank<r>_pid<pid> folders",
                          f"name the folder {engine} wrote its dump into")
        by_rank: dict[tuple[int, int], Path] = {}
        for (tp, pp, _rank, pid), path in dirs:
            if (tp, pp) in by_rank:
                raise refused(self.folder, f"holds two runs' folders for TP{tp} PP{pp} ({by_rank[tp, pp].name}"
                                           f" and {path.name})", "keep one run's folders in it")
            by_rank[tp, pp] = path
        tps = sorted({tp for tp, _ in by_rank})
        pps = sorted({pp for _, pp in by_rank})
        for tp in range(max(tps) + 1):
            for pp in range(max(pps) + 1):
                if (tp, pp) not in by_rank:
                    raise refused(self.folder, f"lacks the folder of TP rank {tp}, PP rank {pp} (it has"
                                               f" {', '.join(p.name for p in by_rank.values())})",
                                  "copy every rank's folder of the run")
        self.tp, self.pp = max(tps) + 1, max(pps) + 1
        self.rank_dirs = [[by_rank[tp, pp] for pp in range(self.pp)] for tp in range(self.tp)]
        passes = None
        for tp in range(self.tp):
            for pp in range(self.pp):
                d = self.rank_dirs[tp][pp]
                got = [n[0] for n, _ in list_files(d, PASS_FILE, "dump folder")]
                if passes is None:
                    passes, first = got, d
                elif got != passes:
                    missing = sorted(set(passes) ^ set(got))[:3]
                    raise refused(d, f"has passes {_span(got)}, {first.name} has {_span(passes)} (e.g. Pass"
                                     f"{missing[0]:05d} is in one only)", "copy every pass of every rank")
        if not passes:
            raise refused(self.rank_dirs[0][0], "has no Pass<NNNNN>.pt files", f"run a request through {engine}"
                                                                               f" with the dump switched on")
        self.passes = passes
        self._cache: tuple[int, list[dict], list[str]] | None = None

    @property
    def label(self) -> str:
        return f"{self.engine} dump {self.folder.name} (TP={self.tp}{f', PP={self.pp}' if self.pp > 1 else ''})"

    def _file(self, tp: int, pp: int, i: int) -> Path:
        return self.rank_dirs[tp][pp] / f"Pass{self.passes[i]:05d}.pt"

    def _load(self, i: int) -> tuple[list[dict], list[str]]:
        """Forward i of every TP rank (its PP stages merged), and each rank's label for messages."""
        if self._cache is not None and self._cache[0] == i:
            return self._cache[1], self._cache[2]
        ranks, labels = [], []
        for tp in range(self.tp):
            merged: dict = {}
            for pp in range(self.pp):
                path = self._file(tp, pp, i)
                for k, v in load_pass(path).items():
                    merged.setdefault(k, v)
            ranks.append(merged)
            labels.append(inert(str(self._file(tp, 0, i))))
        self._cache = (i, ranks, labels)
        return ranks, labels

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ranks, labels = self._load(i)
        return _ids(ranks[0], labels[0])

    def index(self) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for i in range(len(self.passes)):
            out.append(self.tokens(i))  # arrays of their own: the file's mapping goes with its tensors
            self._cache = None  # the scan keeps no tensors
        return out

    def positions_of(self, i: int) -> str:
        """Forward i's positions as messages name them: the file and the field."""
        return f"{inert(str(self._file(0, 0, i)))}: {POSITIONS}"

    def forward(self, i: int) -> Forward:
        ranks, labels = self._load(i)
        ids, pos = _ids(ranks[0], labels[0])
        fw = assemble_forward(ranks, labels, ids, pos, n_kv=self.n_kv, n_layers=self.n_layers, logits_key=None)
        if i + 1 < len(self.passes):
            fw.logits = logits_of(*self._load(i + 1))  # kept loaded: it is the next forward read
        return fw


def _span(passes: list[int]) -> str:
    return f"{passes[0]}..{passes[-1]} ({len(passes)})" if passes else "none"


def _ids(d: dict, label: str) -> tuple[np.ndarray, np.ndarray]:
    import torch

    out = []
    for key in (IDS, POSITIONS):
        t = d.get(key)
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.ndim != 1:
            what = "none" if t is None else (f"a {type(t).__name__}" if not isinstance(t, torch.Tensor)
                                             else f"shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")
            raise UsageError(f"{label}: {key} is {what}; a dumped forward has its token ids and positions as"
                             f" integer vectors (is this a dump of a model whose top module is `model`?)")
        out.append(index_vector(t))
    if len(out[0]) != len(out[1]):
        raise UsageError(f"{label}: {len(out[0])} input_ids but {len(out[1])} positions; the dump is damaged")
    return out[0], out[1]

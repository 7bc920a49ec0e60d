"""SGLang's dumper (python/sglang/srt/debug_utils/dumper.py): one `.pt` per tensor, value + meta.

``DUMPER_ENABLE=1`` (and ``DUMPER_DIR``) makes every ``dumper.dump(name, value, dims=..., **tags)``
write ``<dir>/<exp_name>/step=S___rank=R___dump_index=N___name=NAME___<tag>=<v>....pt`` holding
``{"value": tensor, "meta": {step, rank, dump_index, name, tags..., world_rank, world_size,
sglang_parallel_info: {tp_rank, tp_size, attn_tp_rank, ...}, dims}}``; the model runner calls
``dumper.step()`` after each forward. Its non-intrusive mode hooks every module and writes
``non_intrusive__<module>.output`` (``.output.<i>`` for each tensor of a tuple) and, once per
forward, the batch's ``input_ids``, ``positions``, ``seq_lens`` as core fields.

A tensor names its field either by module path (the non-intrusive names, mapped by names.py) or
by our own field name with a ``layer_id`` tag (``dumper.dump("kraw", k, dims="t (nkv*hd)[tp]",
layer_id=i)``). Its ``dims`` annotation, where given, decides the reassembly: ``[axis]`` shards
concatenate along that dim in the axis' rank order, ``[axis:partial]`` partial sums add up.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from ...errors import UsageError
from ...text import inert
from .load import check, index_vector, load_pt, refused
from .names import FIELDS, LAYER_NUMBER, kind_of_fields, value_kind
from .shards import Assembled, assemble, parse_dims, to_numpy
from .steps import Forward, assemble_forward

_TAG = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=([^=]*)")
_NI = re.compile(r"non_intrusive__(.+?)\.output(?:\.([0-9]{1,4}|next_token_logits))?")
_NUMBER = re.compile(r"0|[1-9][0-9]{0,8}")  # a step or rank as the dumper writes it
_LAYER_ID = re.compile(LAYER_NUMBER)
CORE = ("input_ids", "positions")
_CORE_KIND = {"input_ids": "ids", "positions": "positions", "seq_lens": "ints"}


def parse_name(filename: str) -> dict[str, str] | None:
    """A dumper file name's tags (step=3___rank=0___...___name=x.pt), or None if it is not one."""
    if not filename.endswith(".pt"):
        return None
    tags = {}
    for part in filename[:-3].split("___"):
        m = _TAG.fullmatch(part)
        if not m:
            return None
        tags[m[1]] = m[2]
    if not {"step", "rank", "name"} <= tags.keys() or not (_NUMBER.fullmatch(tags["step"])
                                                           and _NUMBER.fullmatch(tags["rank"])):
        return None
    return tags


def kind_of(name: str) -> str | None:
    """What a record's value must hold (load.check's kinds), by its name: a core field of the batch, a module's
    output (non-intrusive mode), or one of our fields dumped by name."""
    if name in _CORE_KIND:
        return _CORE_KIND[name]
    m = _NI.fullmatch(name)
    if m:
        part = None if m[2] is None else "logits" if m[2] == "next_token_logits" else int(m[2])
        return "floats" if part == "logits" else value_kind(m[1], part)
    return kind_of_fields({name} & FIELDS)


def layer_of(tags: dict[str, str]) -> int | None:
    layer = tags.get("layer_id")
    return int(layer) if layer is not None and _LAYER_ID.fullmatch(layer) else None


def _records(folder: Path) -> list[tuple[dict, Path]]:
    files = [(parse_name(p.name), p) for p in sorted(folder.iterdir()) if p.is_file()]
    return [(t, p) for t, p in files if t is not None]


def holds_records(folder: Path) -> bool:
    """Dumper files in ``folder``, or in its one experiment folder (DUMPER_DIR named instead)."""
    try:
        if _records(folder):
            return True
        subs = [p for p in folder.iterdir() if p.is_dir()]
        return len(subs) == 1 and bool(_records(subs[0]))
    except OSError:
        return False


class DumperFolder:
    def __init__(self, folder: str | Path, n_kv: int | None = None, n_layers: int | None = None):
        self.folder, self.n_kv, self.n_layers = Path(folder), n_kv, n_layers
        if not self.folder.is_dir():
            raise UsageError(f"SGLang dumper dump {inert(str(folder))}: not a folder; name DUMPER_DIR's"
                             f" experiment folder (dump_<date>...)")
        files = _records(self.folder)
        if not files:  # DUMPER_DIR itself: its one experiment folder
            subs = [p for p in sorted(self.folder.iterdir()) if p.is_dir() and _records(p)]
            if len(subs) == 1:
                self.folder, files = subs[0], _records(subs[0])
        if not files:
            subs = [p for p in self.folder.iterdir() if p.is_dir()]
            hint = f" (it has folders: {', '.join(p.name for p in subs[:3])}: name one of them)" if subs else ""
            raise refused(self.folder, f"holds no dumper files (step=..___rank=..___name=...pt){hint}",
                          "name the experiment folder the dumper wrote")
        self.by_step: dict[int, list[tuple[dict, Path]]] = defaultdict(list)
        for tags, path in files:
            self.by_step[int(tags["step"])].append((tags, path))
        self.steps = sorted(s for s, fs in self.by_step.items() if any(t["name"] == "input_ids" for t, _ in fs))
        if not self.steps:
            raise refused(self.folder, "has no input_ids records", "dump with the non-intrusive mode on (it writes"
                                                                   " input_ids and positions each forward)")
        self.label = f"SGLang dumper dump {self.folder.name}"

    def _record(self, path: Path, name: str) -> tuple[object, dict]:
        """A record's value, checked as its name says (load.check), and its meta."""
        obj = load_pt(path)
        if not isinstance(obj, dict) or "value" not in obj or not isinstance(obj.get("meta"), dict):
            raise refused(path, "is not a dumper record (a dict of value and meta)")
        return check(obj["value"], path, "value", kind_of(name)), obj["meta"]

    def positions_of(self, i: int) -> str:
        """Step i's positions as messages name them: the file and the field."""
        path = next((p for t, p in self.by_step[self.steps[i]] if t["name"] == "positions"), self.folder)
        return f"{inert(str(path))}: positions"

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        first: dict[str, tuple[int, Path]] = {}  # each core field from its lowest rank
        for tags, path in self.by_step[self.steps[i]]:
            r = int(tags["rank"])
            if tags["name"] in CORE and (tags["name"] not in first or r < first[tags["name"]][0]):
                first[tags["name"]] = (r, path)
        out = {}
        import torch

        for name, (_, path) in first.items():
            t = self._record(path, name)[0]
            if not isinstance(t, torch.Tensor) or t.ndim != 1:
                raise refused(path, f"{name} is not an integer vector", "dump the forward batch's ids")
            out[name] = index_vector(t)
        if "positions" not in out:
            raise refused(self.folder, f"step {self.steps[i]} has input_ids but no positions",
                          "dump with the non-intrusive mode on")
        if len(out["input_ids"]) != len(out["positions"]):
            raise refused(self.folder, f"step {self.steps[i]}: {len(out['input_ids'])} input_ids but"
                                       f" {len(out['positions'])} positions", "the dump is damaged")
        return out["input_ids"], out["positions"]

    def index(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self.tokens(i) for i in range(len(self.steps))]

    def forward(self, i: int) -> Forward:
        ids, pos = self.tokens(i)
        modules: dict[int, dict] = defaultdict(dict)   # rank -> module path -> tensor or {index: tensor}
        explicit: dict[tuple[str, int | None], dict[int, tuple[object, dict, Path]]] = defaultdict(dict)
        logits = None
        for tags, path in self.by_step[self.steps[i]]:
            name, rank = tags["name"], int(tags["rank"])
            m = _NI.fullmatch(name)
            if m:
                if m[1] == "logits_processor":
                    if logits is None:
                        a = to_numpy(self._record(path, name)[0], path.name)
                        if isinstance(a, str):
                            raise refused(path, a)
                        logits = Assembled(a.astype(np.float32, copy=False))
                    continue
                value = self._record(path, name)[0]
                slot = modules[rank]
                if m[2] is None:
                    slot[m[1]] = value
                else:
                    slot.setdefault(m[1], {})[int(m[2])] = value
            elif name in FIELDS:
                value, meta = self._record(path, name)
                explicit[name, layer_of(tags)][rank] = (value, meta, path)
        ranks = sorted(modules)
        dicts = [{k: ([v[j] for j in sorted(v)] if isinstance(v, dict) else v) for k, v in modules[r].items()}
                 for r in ranks]
        labels = [f"{inert(str(self.folder))}: step {self.steps[i]} rank {r}" for r in ranks]
        fw = assemble_forward(dicts, labels, ids, pos, n_kv=self.n_kv, n_layers=self.n_layers, logits_key=None) \
            if dicts else Forward(ids, pos)
        for key, by_rank in explicit.items():
            fw.keys[key] = _by_dims(by_rank, len(ids))
        fw.logits = logits
        return fw


def _by_dims(by_rank: dict[int, tuple[object, dict, Path]], rows: int) -> Assembled:
    """One explicitly dumped tensor from every rank, put together as its dims annotation says."""
    first = by_rank[min(by_rank)]
    dims = first[1].get("dims")
    layout = parse_dims(dims) if isinstance(dims, str) else None
    if isinstance(layout, str):
        raise refused(first[2], f"dims {inert(dims, 60)!r}: {layout}", "fix the dims string of the dump call")
    axis_name = layout.partial_over or layout.parallel if layout else None
    order = sorted(by_rank, key=lambda r: _axis_rank(by_rank[r][1], axis_name, r))
    arrs = []
    for r in order:
        value, meta, path = by_rank[r]
        a = to_numpy(value, path.name)
        if isinstance(a, str):
            raise refused(path, a, "dump tensors")
        if layout is not None and a.ndim != len(layout.names):
            raise refused(path, f"has {a.ndim} dims, its dims string {inert(dims, 60)!r} names {len(layout.names)}",
                          "fix the dims string of the dump call")
        if layout is not None and layout.token_axis not in (None, 0):
            a = np.moveaxis(a, layout.token_axis, 0)
        if a.ndim == 0 or a.shape[0] != rows:
            raise refused(path, f"has {a.shape[0] if a.ndim else 0} token rows, the forward {rows}",
                          "dump the forward's tokens along dim t")
        arrs.append(a)
    if layout is None or (layout.partial_over is None and layout.shard_axis is None):
        how, axis = "full", -1
    elif layout.partial_over is not None:
        how, axis = "partial", -1
    else:
        how = "heads"
        axis = layout.shard_axis if layout.token_axis in (None, 0) or layout.shard_axis > layout.token_axis \
            else layout.shard_axis + 1
    got = assemble(arrs, how, axis)
    if isinstance(got, str):
        raise refused(first[2], got, "dump every rank of one run")
    return got


def _axis_rank(meta: dict, axis: str | None, world_rank: int) -> int:
    info = meta.get("sglang_parallel_info")
    if axis and isinstance(info, dict) and isinstance(info.get(f"{axis}_rank"), int):
        return info[f"{axis}_rank"]
    return world_rank

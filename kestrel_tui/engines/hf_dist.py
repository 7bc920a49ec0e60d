"""The hf-dist engine: transformers' own tensor and expert parallelism over torch.distributed.

N ranks (engines/hf_dist_rank.py, started and ended as one group by engines/hf_dist_group.py) load the
checkpoint with transformers' plans for Qwen3 / Qwen3-MoE and run the decode in lock step, gloo on
CPU, NCCL on CUDA. Every rank carries the hf engine's hooks; this module gathers what they saw, in rank
order, into the same keys the hf engine makes (docs/engines-distributed.md has the tables):

* a column-parallel key (K, V, Q and the attention output: each rank computes its own heads) is the
  ranks' shards concatenated in rank order, checked against the field registry's shape;
* a replicated key (norms, residuals, router, logits) must be bit-equal on every rank: a rank that
  differs is a finding (``findings``), with every rank's copy kept as ``KEY@R``;
* ``ores`` and ``x`` are replicated too, but reached through an all-reduce of per-rank partial sums (the
  row-parallel o_proj, the FFN's down projection or its experts): each rank's partial is kept as
  ``KEY@R`` and what the all-reduce returned as ``KEY@sum`` (trace/ranks.py), so the detail panel can
  show which rank's share differs. A partial is judged only against the same rank of a run with the same world size; the
  key itself is judged like any other, with tolerance against a run of another world size.

The engine is one of the hf family (engines/hf.py): the checkpoint, its checks, the keys and hf's
options are the family's; the options it adds are its table's (engines/hf_options.py, HF_DIST).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import StepOut
from ..errors import UsageError
from ..trace.fnv import fnv1a64
from ..trace.keys import parse_key
from ..trace.rawstore import RawStore
from ..trace.ranks import rank_key, rank_values, sum_key
from ..trace.run import Cancelled, Trace
from .base import Capabilities, Engine, EngineFailed, EngineSpec, RunRequest, Toggle
from .decode import decode_loop
from .hf import HFFamily, make_family_engine
from .hf_dist_group import Group, RankFailure
from .hf_dist_rank import EXPERTS, RankJob, layer_rules, splits
from .hf_options import HF, HF_DIST, WORLD_SIZES
from .schedule import parse_schedule

NAME = "hf-dist"
NCCL_ENV = {"nccl_algo": "NCCL_ALGO", "nccl_proto": "NCCL_PROTO"}
PER_RUN = ("prefill", "schedule")  # settings each run reads: a change of any other starts a new group of ranks

# How the ranks' buffers make a key. HEADS: a column-parallel projection's heads, one slice per rank;
# WHOLE: every rank holds all of it (replicated).
HEADS, WHOLE = "heads", "whole"
# field -> the projection whose plan style decides whether it is split by heads
HEAD_FIELDS = {"kraw": "self_attn.k_proj", "knorm": "self_attn.k_proj", "kpre": "self_attn.k_proj",
               "k": "self_attn.k_proj", "ks": "self_attn.k_proj", "v": "self_attn.v_proj",
               "vs": "self_attn.v_proj", "qrope": "self_attn.q_proj", "attn": "self_attn.q_proj"}
COLWISE = ("colwise",)
# The most CPU threads (ranks × threads) a core is given. On a 2-core VM a decode step took 3.2× as long
# at 4 ranks × 1 thread, 4.4× at 2 × 2, 8.4× at 4 × 2 as at 2 × 1 (results/hf-dist-bench.md): past 2 a
# core a run crawls and its steps run into the timeout, where they read as a hang.
THREADS_PER_CORE = 2


@dataclass(frozen=True)
class Parallel:
    """How a run is spread: what the header and ``--json`` name."""
    world_size: int
    backend: str                  # gloo | nccl
    plan: str                     # "none", "tp", "tp+ep"
    ep_impl: str | None
    pids: tuple[int, ...] = ()    # rank r's process id at index r, once started

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    def as_dict(self) -> dict:
        return {"world_size": self.world_size, "ranks": list(self.ranks), "backend": self.backend,
                "plan": self.plan, "ep_impl": self.ep_impl, "pids": list(self.pids)}


@dataclass
class DistTrace(Trace):
    """A Trace with what the ranks say beyond the values (the questions the serving-dump readers' traces
    answer too). ``partial``: the keys reached through an all-reduce of per-rank partial sums (their value
    is what the all-reduce gave, plus the residual). ``rank_values(key)``: each rank's share of a key, in
    rank order: its partial sum, its heads of a column-parallel key, or its copy of a replicated key the
    ranks disagree on. ``findings``: those disagreements, one line each."""
    parallel: Parallel | None = None
    partial: set[str] = field(default_factory=set)
    findings: list[str] = field(default_factory=list)
    layout: Mapping[str, str] = field(default_factory=dict, repr=False)

    def rank_values(self, key: str) -> tuple[np.ndarray, ...] | None:
        t = int(key[1:key.index("_")])
        raw = self.positions[t].raw if t < len(self.positions) else None
        own = rank_values(raw, key)
        if own is not None:
            return tuple(np.asarray(a) for a in own)
        n = self.parallel.world_size if self.parallel is not None else 1
        if raw is None or n == 1 or key not in raw or self.layout.get(parse_key(key).field) != HEADS:
            return None
        return tuple(np.split(np.asarray(raw[key]), n, axis=0))


# ---------------------------------------------------------------------------------------------- the machine

def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_problem(world_size: int, device: str, threads: int) -> str | None:
    """Why this machine cannot take ``world_size`` ranks (None: it can): on CUDA a device per rank, on the
    CPU at most THREADS_PER_CORE threads a core in all."""
    if world_size == 1:
        return None
    if device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if world_size > have:
            return (f"world_size={world_size} needs {world_size} CUDA devices (one a rank), and torch sees {have};"
                    f" choose a world size up to {have}")
        return None
    cores = cpu_cores()
    most = THREADS_PER_CORE * cores
    if world_size * threads > most:
        fits = [n for n in map(int, WORLD_SIZES) if n == 1 or n * threads <= most]
        return (f"world_size={world_size} × threads={threads} is {world_size * threads} CPU threads, and this"
                f" machine gives {cores} core{'s' * (cores != 1)} ({THREADS_PER_CORE} threads a core at most);"
                f" choose world_size={max(fits)}" + (" or fewer threads" if threads > 1 else ""))
    return None


def make_hf_dist_engine(spec: EngineSpec, model=None, kv: str = "q8", deep: bool = False) -> "HFDistEngine":
    """The engine table's factory (registry.py)."""
    return make_family_engine(HFDistEngine, spec, model, kv, deep)


# ---------------------------------------------------------------------------------------------- the engine

class HFDistEngine(HFFamily):
    """The hf family's checkpoint, checks, keys and options (hf's and the parallel ones); its runs go to a
    group of ranks, each rank holding its share of the model."""

    name = NAME
    table = HF_DIST
    caps = Capabilities(prefill_from=False, forcing=True, isolate=False, logits=True, raw=True, graft=True)

    def __init__(self, model_dir, model, options: Mapping[str, object], toggles: tuple[Toggle, ...] | None,
                 kv: str = "q8", deep: bool = False):
        super().__init__(model_dir, model, options, toggles, kv=kv, deep=deep)
        self.shapes = _our_config(self.ours, self.model_dir)
        for t in self.toggles:
            for v in t.values:
                self._fits(t.key or t.name, self.table.check(t.key or t.name, v), f"toggle {t.name}")
        for name in ("world_size", "ep", "split_sums"):
            self._fits(name, self.options[name], "option")
        self.notes: tuple[str, ...] = self._shared_cores() + self._experts_whole()
        self.findings: list[str] = []  # the last run's replicated keys the ranks disagreed on
        self._group: Group | None = None
        self._group_key = None
        self._lock = threading.Lock()

    def default_toggles(self) -> tuple[Toggle, ...]:
        return self.table.default_toggles(self.options, moe=self.moe, fits=self._offered)

    def _offered(self, name: str, value: str) -> bool:
        """A world size the default toggles offer: one the heads split over and the machine takes."""
        if name == "split_sums":  # an option of the reference's, never a toggle
            return value == self.options[name]
        if name != "world_size":
            return True
        n = int(value)
        return all(h % n == 0 for h in self.heads) and \
            machine_problem(n, self.options["device"], self.options["threads"]) is None

    def _fits(self, name: str, value, where: str) -> None:
        """A world size, EP or device the model and the machine can take (each toggle value, each option)."""
        if name == "split_sums" and value != "off":
            n = int(value)
            bad = [f"attention heads {self.heads[0]}"] if self.heads[0] % n else []
            if bad:
                raise UsageError(f"{NAME} engine: {where} split_sums={value}: the model's {bad[0]} do not split"
                                 f" over {n} ranks; choose a count that divides them, or off")
        elif name == "world_size":
            n = int(value)
            bad = [f"{what} {h}" for what, h in zip(("attention heads", "kv heads"), self.heads) if h % n]
            if bad:
                raise UsageError(f"{NAME} engine: {where} world_size={value}: the model's {' and '.join(bad)}"
                                 f" do not split over {n} ranks; choose a world size that divides them")
            problem = machine_problem(n, self.options["device"], self.options["threads"])
            if problem:
                raise UsageError(f"{NAME} engine: {where} {problem}")
        elif name == "ep" and value == "on" and not self.moe:
            raise UsageError(f"{NAME} engine: {where} ep=on: expert parallelism needs a qwen3_moe model, and"
                             f" this one is dense qwen3; drop ep")

    def _shared_cores(self) -> tuple[str, ...]:
        """A note when the starting world size gives the ranks more threads than the machine has cores."""
        n, threads, cores = int(self.options["world_size"]), self.options["threads"], cpu_cores()
        if self.options["device"] != "cpu" or n * threads <= cores:
            return ()
        return (f"{NAME}: world_size={n} × threads={threads} runs {n * threads} CPU threads on {cores}"
                f" core{'s' * (cores != 1)}: they take turns, so each step is slower (the bits are the same)",)

    def _experts_whole(self) -> tuple[str, ...]:
        """A note when a run may split this MoE by TP alone (world_size > 1, ep=off) and transformers' TP
        plan leaves its experts whole on every rank (from transformers 5.25 the plan has no rule for them):
        the FFN branch then has no all-reduce, so x has no per-rank partial sums."""
        if not self.moe or experts_split_by_tp(self.model_dir):
            return ()
        if not (self._may_run("world_size", lambda v: int(v) > 1) and self._may_run("ep", "off".__eq__)):
            return ()
        import transformers

        return (f"{NAME}: transformers {transformers.__version__}'s tensor-parallel plan splits no experts:"
                f" with ep=off every rank runs all of them whole, so a MoE layer's x is replicated and has no"
                f" per-rank partial sums (x@R, x@sum); ep=on splits the experts",)

    def _may_run(self, name: str, fits) -> bool:
        """Whether the option ``name`` or a toggle of it may take a value that ``fits``."""
        values = [str(self.options[name])]
        values += [v for t in self.toggles if (t.key or t.name) == name for v in t.values]
        return any(fits(v) for v in values)

    def parallel(self, values: Mapping[str, str]) -> Parallel:
        """The world size, backend and plan of a run with these toggle values (and the ranks' pids once
        this engine's group is running)."""
        s = self.settings(values)
        n, ep = int(s["world_size"]), s["ep"] == "on"
        group = self._group if self._group_key == _group_key(s) else None
        return Parallel(n, "nccl" if s["device"] == "cuda" else "gloo",
                        "none" if n == 1 else "tp+ep" if ep else "tp", s["ep_impl"] if ep and n > 1 else None,
                        group.pids if group is not None else ())

    def describe(self, values: Mapping[str, str]) -> str:
        p = self.parallel(values)
        moved = [t for t in self.toggles if t.name in values and values[t.name] != t.default]
        rest = [f"{t.name}={values[t.name]}" for t in moved if (t.key or t.name) not in ("world_size", "ep", "ep_impl")]
        plan = {"none": [], "tp": ["tp"], "tp+ep": ["tp+ep", p.ep_impl]}[p.plan]
        schedule = self.schedule(values)
        if str(schedule) != "decode" and "schedule" not in {t.key or t.name for t in moved}:  # the side's option
            rest.append(f"schedule={schedule}")
        return f"{self.name} ({', '.join([f'world_size={p.world_size}', *plan, p.backend, *rest])})"

    @property
    def device_name(self) -> str:
        p = self.parallel({})
        return f"{p.world_size} × {self.options['device']} ranks over {p.backend} ({self.versions()})"

    def prefill_problem(self, reference: Engine) -> str | None:
        return f"{self.name} cannot take another engine's KV rows (each rank holds its own heads)"

    # -- the group
    def _ensure_group(self, s: Mapping[str, object]) -> Group:
        key = _group_key(s)
        if self._group is not None and self._group_key == key:
            return self._group
        self._end_group()
        n, threads = int(s["world_size"]), s["threads"]
        cuda = s["device"] == "cuda"
        problem = machine_problem(n, s["device"], threads)  # a device toggle may have moved the run
        if problem:
            raise UsageError(f"{NAME} engine: {problem}")
        env = {"OMP_NUM_THREADS": str(threads)}
        if not cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the mesh goes where the ranks' tensors are: the CPU
        for option, var in NCCL_ENV.items():
            if s[option] != "default":
                env[var] = s[option]
        # the hf options the ranks load and run with; prefill is this engine's loop's
        job = RankJob(model_dir=self.model_dir, n_layers=self.n_layers,
                      settings={k: s[k] for k in HF.options if k not in PER_RUN},
                      kv=self.kv, deep=self.deep, world_size=n, ep=s["ep"] == "on", ep_impl=s["ep_impl"],
                      threads=threads, split_sums=0 if s["split_sums"] == "off" else int(s["split_sums"]),
                      store="", timeout_s=max(s["timeout"] * 4, s["load_timeout"]))
        group = Group(job, env, s["load_timeout"], s["timeout"])
        try:
            self._layout = layout_of(group.infos, self.heads, self.kv)
        except RankFailure:
            group.end()
            raise
        self._group, self._group_key = group, key
        return group

    def _end_group(self) -> None:
        if self._group is not None:
            self._group.end()
        self._group, self._group_key = None, None

    def close(self) -> None:
        self._end_group()
        super().close()

    # -- a run
    def run(self, req: RunRequest):
        s = self.settings(req.values)
        n = int(s["world_size"])
        if s["ep"] == "on" and n > 1 and self.n_experts % n:
            raise UsageError(f"{NAME} engine: ep=on with world_size={n}: the model's {self.n_experts} experts do"
                             f" not split over {n} ranks; choose a world size that divides them, or ep=off")
        if req.graft is not None:
            from .hf_hooks import GRAFTED  # torch: only where a graft is asked for

            unknown = sorted({f for f, _ in req.graft.sites} - set(GRAFTED))
            if unknown:
                raise UsageError(f"{NAME} engine: no graft at {', '.join(unknown)} (docs/engines-hf.md: where a"
                                 f" graft goes)")
        trace = DistTrace(backend=self.describe(req.values), prompt=list(req.prompt), store=RawStore())
        self.findings = trace.findings
        at = "while loading the model"
        with self._lock:
            try:
                group = self._ensure_group(s)
                trace.parallel, trace.layout = self.parallel(req.values), self._layout

                def step(ids: list[int], pos0: int) -> StepOut:
                    nonlocal at
                    at = f"at position {pos0}" if len(ids) == 1 else f"at positions {pos0}-{pos0 + len(ids) - 1}"
                    fed = graft_shares(req.graft, pos0, len(ids), n, self._layout, self.kv)
                    columns = gather(group.step(ids, pos0, req.cancel, fed), pos0, len(ids), self._layout,
                                     self.shapes)
                    for hashes, raw, found in columns:
                        trace.findings += found
                        trace.partial.update(k for k in hashes if sum_key(k) in raw)
                    logits = np.stack([np.asarray(raw[f"t{pos0 + m}_logits"], np.float32)
                                       for m, (_, raw, _) in enumerate(columns)])
                    return StepOut(logits=logits, hashes=[c[0] for c in columns], raw=[c[1] for c in columns])

                # each rank starts a new cache at position 0: the rollout's restart needs nothing more
                return decode_loop(req, trace, step, token_prefill=s["prefill"] == "token",
                                   schedule=parse_schedule(s["schedule"]), restart=lambda: None)
            except RankFailure as f:
                self._end_group()
                who = f"rank {f.rank} of {n} " if f.rank is not None else ""
                kept = len(trace.positions)
                raise EngineFailed(f"{NAME} engine: {at}, {who}{f.what}; all {n} rank{'s' * (n != 1)} ended,"
                                   f" {kept} position{'s' * (kept != 1)} kept", partial=trace) from None
            except (Cancelled, KeyboardInterrupt):
                self._end_group()  # a rank may be mid-step: the group cannot be trusted to be in step
                raise


# a graft site -> the reference's fields the rank's hooks read for it (hf_hooks: the attention's rows are
# rebuilt from k and v, q8 ones with their scales)
ROWS = ("kpre", "k", "ks", "v", "vs")


def graft_shares(graft, pos0: int, M: int, n: int, layout: Mapping[str, str], kv: str) -> list | None:
    """Per rank: (the graft's sites, {position: key -> the reference's value}) for a step's positions, each
    rank given its share: the slice its shard holds of a key split by heads, the whole value of a replicated
    one; None without a graft."""
    if graft is None:
        return None
    fields = set()
    for f, layer in graft.sites:
        rows = (("k", "v") + (("ks", "vs") if kv == "q8" else ())) if f in ROWS else (f,)
        fields.update((g, layer) for g in rows)
    out = [(graft.sites, {}) for _ in range(n)]
    for t in range(pos0, pos0 + M):
        raw = graft.reference.positions[t].raw
        for f, layer in fields:
            key = f"t{t}_{f}" if layer is None else f"t{t}_l{layer}_{f}"
            value = np.asarray(raw[key])
            parts = np.split(value, n, axis=0) if layout.get(f, WHOLE) == HEADS else [value] * n
            for r in range(n):
                out[r][1].setdefault(t, {})[key] = parts[r]
    return out


def _group_key(s: Mapping[str, object]) -> tuple:
    return tuple((k, v) for k, v in sorted(s.items()) if k not in PER_RUN)


def experts_split_by_tp(model_dir: str) -> bool:
    """Whether transformers' TP plan for this checkpoint shards a MoE's experts: up to transformers 5.24
    a slice of every expert's intermediate on each rank (``moe_tp_experts``), all-reduced; from 5.25
    the plan has no rule for them (its experts are split only by EP)."""
    from transformers import AutoConfig

    return splits(layer_rules(AutoConfig.from_pretrained(model_dir).base_model_tp_plan), EXPERTS)


def _our_config(model, model_dir: str):
    """Our Config of the checkpoint (the field registry's shapes), or None when our loader refuses it:
    the ranks are then only checked against each other."""
    if model is not None:
        return model.cfg
    from ..model.config import load_config

    try:
        return load_config(model_dir, "f32")
    except UsageError:
        return None


# ---------------------------------------------------------------------------------------------- gathering

def layout_of(infos: list[dict], heads: tuple[int, int], kv: str) -> dict[str, str]:
    """field -> HEADS | WHOLE from the styles the ranks applied; every rank must report the same plan and
    its share of the heads, else it disagrees on shapes."""
    n = len(infos)
    for r, info in enumerate(infos):
        if info["styles"] != infos[0]["styles"]:
            raise RankFailure(r, f"disagrees on the plan: {info['styles']} where rank 0 has {infos[0]['styles']}")
    styles = infos[0]["styles"]
    out = {}
    for field, module in HEAD_FIELDS.items():
        split = styles.get(module, "") in COLWISE and not (kv == "f32" and field in ("ks", "vs"))
        out[field] = HEADS if split else WHOLE
    for r, info in enumerate(infos):
        want = tuple(h // n if styles.get(f"self_attn.{p}_proj", "") in COLWISE else h
                     for p, h in zip("qk", heads))
        if tuple(info["heads"]) != want:
            raise RankFailure(r, f"disagrees on shapes: it holds {info['heads']} (q, kv) heads where"
                                 f" {want} fit {n} rank{'s' * (n != 1)}")
    return out


def _shape(a) -> str:
    return "[" + ", ".join(map(str, np.shape(a))) + "]"


def gather(payloads: list[dict], pos0: int, M: int, layout: Mapping[str, str], cfg) -> list[tuple]:
    """The ranks' payloads of one step -> per column (hashes, raw, findings): every key gathered in rank
    order, partial sums as KEY@r<R> and KEY@sum, and the replicated keys the ranks disagree on.
    Raises RankFailure for a rank whose keys or shapes do not fit."""
    from ..trace.fields import BY_NAME

    n = len(payloads)
    out = []
    for m in range(M):
        cols = [p["raw"][m] for p in payloads]
        keys = list(cols[0])
        for r in range(1, n):
            if list(cols[r]) != keys:
                extra = sorted(set(cols[r]) ^ set(keys))[:3]
                raise RankFailure(r, f"disagrees on the keys of position {pos0 + m}: {', '.join(extra)}")
        hashes, raw, found = {}, {}, []
        for key in keys:
            k = parse_key(key)
            arrs = [c[key] for c in cols]
            expect = None if cfg is None else BY_NAME[k.field].shape(cfg, k.layer)
            if layout.get(k.field, WHOLE) == HEADS:
                for r, a in enumerate(arrs):
                    if a.shape != arrs[0].shape or (expect is not None and a.shape[0] * n != expect[0]):
                        want = f"1/{n} of [{', '.join(map(str, expect))}]" if expect else _shape(arrs[0])
                        raise RankFailure(r, f"disagrees on shapes: its shard of {key} is {_shape(a)} where"
                                             f" {want} fits")
                full = np.concatenate(arrs, axis=0)
            else:
                full = arrs[0]
                for r, a in enumerate(arrs):
                    if a.shape != full.shape or a.dtype != full.dtype or (expect is not None and a.shape != expect):
                        raise RankFailure(r, f"disagrees on shapes: {key} is {_shape(a)} {a.dtype} where"
                                             f" {_shape(expect if expect is not None else full)} fits")
                differ = [r for r in range(1, n) if arrs[r].tobytes() != full.tobytes()]
                if differ:
                    found.append(f"{key}: replicated, but rank{'s' * (len(differ) > 1)}"
                                 f" {', '.join(map(str, differ))} differ{'s' * (len(differ) == 1)} from rank 0")
                    raw.update({rank_key(key, r): a for r, a in enumerate(arrs)})
            raw[key] = full
            hashes[key] = fnv1a64(full)
        parts = [p["partial"][m] for p in payloads]
        for key in parts[0]:
            if any(key not in c for c in parts):
                missing = next(r for r, c in enumerate(parts) if key not in c)
                raise RankFailure(missing, f"sent no partial sum of {key} where rank 0 did")
            for r, c in enumerate(parts):
                for i, (part, _) in enumerate(c[key]):
                    raw[rank_key(key, r) + (f".{i}" if i else "")] = part
            reduced = parts[0][key][-1][1]
            raw[sum_key(key)] = reduced
            differ = [r for r in range(1, n) if parts[r][key][-1][1].tobytes() != reduced.tobytes()]
            if differ:
                found.append(f"{key}: the all-reduce returned other bits on rank"
                             f"{'s' * (len(differ) > 1)} {', '.join(map(str, differ))} than on rank 0")
        if n == 1:  # split_sums: one rank's row-parallel sums as N ranks' partials (no all-reduce, no @sum)
            for key, split in payloads[0].get("split", [{}] * M)[m].items():
                raw.update({rank_key(key, r): part for r, part in enumerate(split)})
        out.append((hashes, raw, found))
    return out

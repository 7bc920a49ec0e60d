"""Faults planted in the hf-dist engine's ranks: the hooks module the tests hand the ranks.

A rank imports the module named by KESTREL_RANK_HOOKS once its model is loaded and calls its
``install(rank)`` (kestrel_tui/engines/hf_dist_rank.py); ``env(faults)`` gives the variables that make
the next group's ranks import this one, with ``faults`` in KESTREL_DIST_FAULT:
``RANK:KIND:POSITION[,...]`` plants failures for the failure tests (``Fault``), and
``RANK:KIND:L<layer>.<module>`` a bug that exists only under parallelism, in one rank's shard of a
weight once transformers has sharded it (``ShardFault``), so the planted-bug tests can check that the
tool names the layer, the field and the rank. scripts/findings_tp.py plants its bugs the same way.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kestrel_tui.engines.hf_dist_rank import HOOKS_ENV

FAULT_ENV = "KESTREL_DIST_FAULT"
FAULT_KINDS = ("exit", "raise", "hang", "shape", "replica")
SHARD_FAULTS = ("scale_shard", "swap_shards", "ep_misplace")
EXIT_CODE = 3  # the planted exit's code: the engine's message shows it
SHARD_SCALE = 1.01  # scale_shard's factor: far above rounding (NMSE 1e-4 on the shard), small enough to look real
HERE = str(Path(__file__).resolve().parent)


def env(faults: str | None) -> dict[str, str]:
    """The variables that plant ``faults`` in the ranks of the next group started (a group's ranks read
    them when they start): this module as their hooks, found on PYTHONPATH."""
    rest = os.environ.get("PYTHONPATH")
    return {HOOKS_ENV: __name__, FAULT_ENV: faults or "",
            "PYTHONPATH": HERE + (os.pathsep + rest if rest else "")}


@contextlib.contextmanager
def planted(faults: str | None):
    """``env(faults)`` in this process's environment for the block, restored after."""
    old = {k: os.environ.get(k) for k in (HOOKS_ENV, FAULT_ENV, "PYTHONPATH")}
    os.environ.update(env(faults))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class Fault:
    """A planted fault: at ``position`` the rank ``rank`` exits (code EXIT_CODE), raises, hangs before it
    starts the step, sends a kraw shard one row short (shape), or flips a bit of its replicated nrm."""
    rank: int
    kind: str
    position: int

    def due(self, rank: int, pos0: int, M: int) -> bool:
        return rank == self.rank and pos0 <= self.position < pos0 + M

    def before(self) -> None:
        if self.kind == "exit":
            os._exit(EXIT_CODE)
        if self.kind == "raise":
            raise RuntimeError("planted fault")
        if self.kind == "hang":
            while True:
                time.sleep(60)

    def after(self, payload: dict, pos0: int) -> None:
        raw = payload["raw"][self.position - pos0]
        if self.kind == "shape":
            key = next(k for k in raw if k.endswith("_kraw"))
            raw[key] = raw[key][1:]
        elif self.kind == "replica":
            key = next(k for k in raw if k.endswith("_nrm"))
            a = raw[key].copy()
            a.view("uint32")[0] ^= 1
            raw[key] = a


@dataclass(frozen=True)
class ShardFault:
    """A planted bug in this rank's shards, made once the model is loaded and sharded (one rank holds no
    shard, so a run of world size 1 is untouched): ``scale_shard``, rank ``rank``'s shard of the module's
    weight times SHARD_SCALE; ``swap_shards`` (rank ``*``: every rank takes part in the exchange), ranks 0
    and 1 hold each other's shard; ``ep_misplace`` (under EP), rank ``rank``'s experts of the layer one
    place off: its i-th local expert holds the weights of its (i+1)-th, its last those of its first."""
    rank: int | None
    kind: str
    layer: int
    module: str

    def plant(self, model, rank: int, world_size: int) -> None:
        import torch
        import torch.distributed as dist

        if world_size == 1:
            return
        layers = model.model.layers
        if self.layer >= len(layers):
            raise RuntimeError(f"{FAULT_ENV}: layer {self.layer}: the model has {len(layers)}")
        module = layers[self.layer].get_submodule(self.module)
        with torch.no_grad():
            if self.kind == "scale_shard" and rank == self.rank:
                _local(module.weight).mul_(SHARD_SCALE)
            elif self.kind == "swap_shards":
                w = _local(module.weight)
                shards = [torch.empty_like(w) for _ in range(world_size)]
                dist.all_gather(shards, w.contiguous())
                if rank < 2:
                    w.copy_(shards[1 - rank])
            elif self.kind == "ep_misplace" and rank == self.rank:
                if not getattr(module, "_is_expert_parallel", False):
                    raise RuntimeError(f"{FAULT_ENV}: ep_misplace needs ep=on (the experts are not split whole)")
                for p in (module.gate_up_proj, module.down_proj):
                    w = _local(p)
                    w.copy_(torch.roll(w, -1, dims=0))


def _local(p):
    """The storage of this rank's shard (a DTensor's local tensor, written in place)."""
    return p.to_local() if hasattr(p, "to_local") else p


def faults_from(text: str | None) -> tuple[Fault | ShardFault, ...]:
    """``RANK:KIND:POSITION`` and ``RANK:KIND:L<layer>.<module>`` items, comma-separated -> the planted
    faults (``ep_misplace`` needs only ``L<layer>``: its module is the layer's experts)."""
    out = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        try:
            rank, kind, where = item.split(":")
            if kind in SHARD_FAULTS:
                layer, _, module = where.partition(".")
                if not layer.startswith("L") or (kind == "swap_shards") != (rank == "*"):
                    raise ValueError
                out.append(ShardFault(None if rank == "*" else int(rank), kind, int(layer[1:]),
                                      module or "mlp.experts"))
            else:
                out.append(Fault(int(rank), kind, int(where)))
        except ValueError:
            raise SystemExit(f"{FAULT_ENV}={text!r}: want RANK:KIND:POSITION (e.g. 1:exit:5) or RANK:KIND:L<layer>."
                             f"<module> (e.g. 1:scale_shard:L1.self_attn.k_proj, *:swap_shards:L1.mlp.down_proj,"
                             f" 1:ep_misplace:L1)") from None
        if kind not in FAULT_KINDS + SHARD_FAULTS:
            raise SystemExit(f"{FAULT_ENV}: kind {kind!r}: choose from {', '.join(FAULT_KINDS + SHARD_FAULTS)}")
    return tuple(out)


def install(rank) -> None:
    """The rank's hooks (hf_dist_rank.Rank): the shard faults planted now, the step faults wrapped around
    its begin_step (before it says it started) and its step (on the payload it sends)."""
    faults = faults_from(os.environ.get(FAULT_ENV))
    for f in faults:
        if isinstance(f, ShardFault):
            f.plant(rank.model, rank.rank, rank.job.world_size)
    steps = [f for f in faults if isinstance(f, Fault)]
    begin, step = rank.begin_step, rank.step

    def begin_step(ids, pos0):
        for f in steps:
            if f.due(rank.rank, pos0, len(ids)):
                f.before()
        begin(ids, pos0)

    def planted_step(ids, pos0):
        payload = step(ids, pos0)
        for f in steps:
            if f.due(rank.rank, pos0, len(ids)):
                f.after(payload, pos0)
        return payload

    rank.begin_step, rank.step = begin_step, planted_step

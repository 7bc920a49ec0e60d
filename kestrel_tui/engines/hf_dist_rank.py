"""One rank of the hf-dist engine: ``python -m kestrel_tui.engines.hf_dist_rank`` (engines/hf_dist.py).

The engine starts N of these with RANK / LOCAL_RANK / WORLD_SIZE set, as torchrun would. Each joins
torch.distributed through a file store in the engine's private folder (gloo on CPU, NCCL on CUDA),
loads the checkpoint with transformers' own plans (``DistributedConfig``: the model's
``base_model_tp_plan``, and its ``base_model_ep_plan`` when EP is on), hooks it with the hf engine's
Capture (engines/hf_hooks.py) and then serves steps: the engine sends the same tokens to every rank,
every rank runs transformers' forward (the collectives meet across ranks) and sends back what its
hooks saw, shards as they are. The engine gathers them (hf_dist.gather).

What the hooks cannot see is the tensor a row-parallel module hands to its all-reduce: the hook on
the module fires after the reduction, which works in place. So torch.distributed.all_reduce is
wrapped in this process: inside ``o_proj`` (the attention branch) and ``mlp`` (the FFN branch) each
all-reduce's input is copied before it is reduced, as that rank's partial sum of the branch output.

Messages to the engine are pickles on the real stdout (fd 1 goes to stderr, so nothing a library
prints mixes in); commands come as pickles on stdin.

``KESTREL_RANK_HOOKS`` names a module each rank imports once it has loaded the model and hands itself
to (``install(rank)``), before it says it is ready: the tests plant their faults through it
(tests/rankfaults.py), a rank that fails at a step (``Rank.begin_step``) or a bug in one rank's shard.
"""
from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass

from .hf_torch import first_line, load_model, quiet, torch_flags

HOOKS_ENV = "KESTREL_RANK_HOOKS"

EXPERTS = "mlp.experts"  # a MoE layer's experts, as transformers' plans name them
# modules whose plan style decides a key's layout, as transformers' plans name them (hf_dist.layout_of
# reads the styles back); the router (mlp.gate), the norms and the embedding's output are replicated
PLANNED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", EXPERTS,
           "mlp.down_proj")
# branch module -> the key its all-reduced output lands in (the residual add follows)
BRANCHES = {"self_attn.o_proj": "ores", "mlp": "x"}


@dataclass(frozen=True)
class RankJob:
    """What every rank loads; sent once, on stdin, before any step."""
    model_dir: str
    n_layers: int
    settings: dict            # the hf options (attn_implementation, dtype, device, tf32, deterministic)
    kv: str
    deep: bool
    world_size: int
    ep: bool
    ep_impl: str              # transformers' ep_implementation: all_reduce | all_to_all
    threads: int              # torch CPU threads per rank
    split_sums: int           # at world size 1: the row-parallel sums also as this many ranks' partials (0: not)
    store: str                # the file store torch.distributed meets in
    timeout_s: float          # collectives give up after this (the engine kills the group first)


class PartialSums:
    """The tensors row-parallel modules hand to torch.distributed.all_reduce, per branch and layer.

    Pre-hooks on each layer's ``o_proj`` and ``mlp`` name the branch; the wrapped all_reduce copies its
    input (this rank's partial sum) and its result (the reduced branch output) while one is named."""

    def __init__(self, model):
        import torch.distributed as dist

        self._dist, self._real = dist, dist.all_reduce
        self.branch: tuple[str, int] | None = None
        self.seen: dict[tuple[str, int], list] = {}
        self._hooks = []
        for li, L in enumerate(model.model.layers[:model.config.num_hidden_layers]):
            for path, field in BRANCHES.items():
                module = L.get_submodule(path)
                self._hooks += [module.register_forward_pre_hook(self._enter(field, li)),
                                module.register_forward_hook(self._leave)]
        dist.all_reduce = self._all_reduce

    def _enter(self, field: str, li: int):
        def hook(module, args):
            self.branch = (field, li)
        return hook

    def _leave(self, module, args, out):
        self.branch = None

    def _all_reduce(self, tensor, *args, **kwargs):
        if self.branch is None:
            return self._real(tensor, *args, **kwargs)
        part = tensor.detach().clone()
        work = self._real(tensor, *args, **kwargs)
        self.seen.setdefault(self.branch, []).append((part, tensor.detach().clone()))
        return work

    def take(self, pos0: int, M: int) -> list[dict]:
        """Per column: key -> [(partial, reduced)] f32 [hidden] each, for every all-reduce of the step."""
        cols: list[dict] = [{} for _ in range(M)]
        for (field, li), pairs in self.seen.items():
            for part, reduced in pairs:
                p = part.float().reshape(M, -1).cpu().numpy()
                r = reduced.float().reshape(M, -1).cpu().numpy()
                for m in range(M):
                    cols[m].setdefault(f"t{pos0 + m}_l{li}_{field}", []).append((p[m].copy(), r[m].copy()))
        self.seen = {}
        return cols


class SplitSums:
    """At world size 1, the row-parallel sums as N ranks would make them: forward hooks on each layer's
    ``o_proj`` and (dense) ``mlp.down_proj`` compute, beside the module's own output, the product of each
    rank's slice of the inputs with its columns of the weight — the GEMM a TP=N rank runs on its shard —
    so a TP=N run's partial sums (``KEY@R``) are held against the same rank's share here."""

    def __init__(self, model, n: int):
        self.n, self.seen = n, {}
        self._hooks = []
        for li, L in enumerate(model.model.layers[:model.config.num_hidden_layers]):
            for path, field in (("self_attn.o_proj", "ores"), ("mlp.down_proj", "x")):
                try:
                    module = L.get_submodule(path)
                except AttributeError:  # a MoE layer: its experts have no one down_proj
                    continue
                self._hooks.append(module.register_forward_hook(self._split(field, li)))

    def _split(self, field: str, li: int):
        def hook(module, args, out):
            import torch.nn.functional as F

            x, w = args[0], module.weight
            width = x.shape[-1] // self.n
            self.seen[field, li] = [F.linear(x[..., r * width:(r + 1) * width].contiguous(),
                                             w[:, r * width:(r + 1) * width].contiguous()) for r in range(self.n)]
        return hook

    def take(self, pos0: int, M: int) -> list[dict]:
        """Per column: key -> [(partial, None)] for each rank, f32 [hidden] each (PartialSums' shape, no sum)."""
        cols: list[dict] = [{} for _ in range(M)]
        for (field, li), parts in self.seen.items():
            for part in parts:
                p = part.float().reshape(M, -1).cpu().numpy()
                for m in range(M):
                    cols[m].setdefault(f"t{pos0 + m}_l{li}_{field}", []).append(p[m].copy())
        self.seen = {}
        return cols


def layer_rules(plan) -> dict[str, str]:
    """A plan's rules by their module's path inside a decoder layer: the model's plan names it
    ``model.layers.*.X``, its config's base plan ``layers.*.X``."""
    return {k.removeprefix("model.").removeprefix("layers.*."): v for k, v in (plan or {}).items()}


def splits(rules, module: str) -> bool:
    """Whether a rule of ``layer_rules`` shards ``module`` or one of its parameters."""
    return any(r == module or r.startswith(module + ".") for r in rules)


def plan_styles(model, job: RankJob) -> dict[str, str]:
    """PLANNED module -> the style transformers applied to it on this rank ("" where none)."""
    if job.world_size == 1:
        return dict.fromkeys(PLANNED, "")
    tp = layer_rules(model.tp_plan)
    ep = layer_rules(model.ep_plan) if job.ep else {}
    out = {}
    for name in PLANNED:
        expert = any(name == e or name.startswith(e + ".") for e in ep)  # EP rules take precedence
        out[name] = ep.get(name, "") if expert else tp.get(name, "")
    return out


class Rank:
    """The loaded, hooked model of this rank and its KV cache."""

    def __init__(self, job: RankJob, rank: int):
        import datetime

        import torch
        import torch.distributed as dist

        from .hf_hooks import Capture

        self.job, self.rank = job, rank
        cuda = job.settings["device"] == "cuda"
        device = None
        if cuda:  # bound before the group is made, so NCCL's communicator is this rank's device's
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(job.threads)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{job.store}", rank=rank,
                                world_size=job.world_size, timeout=datetime.timedelta(seconds=job.timeout_s),
                                device_id=device)
        extra = {}
        if job.world_size > 1:
            from transformers.distributed import DistributedConfig

            extra["distributed_config"] = DistributedConfig(
                tp_size=job.world_size, **({"ep_size": job.world_size, "ep_implementation": job.ep_impl}
                                           if job.ep else {}))
        # one rank: the whole model where the rank runs; several: where transformers' plan put the shards
        where = (device if cuda else "cpu") if job.world_size == 1 else None
        self.model = model = load_model(job.model_dir, job.settings, job.n_layers, where, **extra)
        self.capture = Capture(model, job.kv, job.deep)
        self.partials = PartialSums(model) if job.world_size > 1 else None
        self.split = SplitSums(model, job.split_sums) if job.world_size == 1 and job.split_sums > 1 else None
        self.cache = None
        self.fed = None  # this step's graft: (sites, {position: the reference's values, this rank's share})
        self._graft = None

    def feed(self, fed) -> None:
        """What the engine sent with the next step: None, or a graft's sites and this rank's share of the
        reference's values at them for the step's positions (hf_dist.graft_shares)."""
        self.fed = fed

    def info(self) -> dict:
        import torch
        import transformers

        attn = self.model.model.layers[0].self_attn
        heads = tuple(_local_rows(getattr(attn, p).weight) // self.capture.shape.head_dim
                      for p in ("q_proj", "k_proj"))
        p = next(self.model.parameters())
        return {"pid": os.getpid(), "device": str(p.device), "heads": heads,
                "styles": plan_styles(self.model, self.job),
                "versions": f"transformers {transformers.__version__}, torch {torch.__version__}"}

    def begin_step(self, ids: list[int], pos0: int) -> None:
        """Called before the rank tells the engine it started a step: nothing here (a hook's place)."""

    def step(self, ids: list[int], pos0: int) -> dict:
        from transformers import DynamicCache

        if pos0 == 0:  # a new run
            self.cache = DynamicCache(config=self.model.config)
            self._graft = _FedGraft(self.fed[0]) if self.fed is not None else None
            self.capture.end()  # the last run's graft, if any, goes
            self.capture.begin(None, graft=self._graft)
        if self._graft is not None and self.fed is not None:
            self._graft.add(self.fed[1])
        with torch_flags(self.job.settings), quiet():
            out = self.capture.step(ids, pos0, self.cache, raw=True)
        partial = self.partials.take(pos0, len(ids)) if self.partials is not None else [{} for _ in ids]
        split = self.split.take(pos0, len(ids)) if self.split is not None else [{} for _ in ids]
        return {"raw": out.raw, "partial": partial, "split": split}


class _FedGraft:
    """A Graft (engines/base.py) as the Capture reads it, its reference only the values sent so far:
    ``reference.positions[t].raw`` for every position this run has stepped."""

    def __init__(self, sites):
        self.sites, self.reference = frozenset(sites), self
        self.positions: dict[int, _Fed] = {}

    def add(self, values: dict) -> None:
        for t, raw in values.items():
            self.positions[t] = _Fed(raw)


@dataclass(frozen=True)
class _Fed:
    raw: dict


def _local_rows(w) -> int:
    """A weight's output rows on this rank (a DTensor's local shard)."""
    return (w.to_local() if hasattr(w, "to_local") else w).shape[0]


def _said(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__


def _install_hooks(rank: Rank) -> None:
    """The module HOOKS_ENV names, handed the rank (tests/rankfaults.py plants faults this way)."""
    import importlib

    name = os.environ.get(HOOKS_ENV)
    if name:
        importlib.import_module(name).install(rank)


def serve() -> None:
    from .child_main import safe_path

    safe_path()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what transformers and torch print goes to stderr, never into the message stream
    commands = sys.stdin.buffer
    rank = int(os.environ["RANK"])

    def send(*msg):
        pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()

    try:
        job: RankJob = pickle.load(commands)
        r = Rank(job, rank)
        _install_hooks(r)
        send("ready", r.info())
        while True:
            # ("step", ids, pos0, fed); the engine ends a rank by its group
            _, ids, pos0, fed = pickle.load(commands)
            r.feed(fed)
            r.begin_step(ids, pos0)
            send("started", pos0)
            send("out", pos0, r.step(ids, pos0))
    except EOFError:
        return  # the engine closed our stdin: nothing to tell
    except Exception as e:
        send("failed", _said(e))
        sys.exit(1)


if __name__ == "__main__":
    serve()

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

``KESTREL_DIST_FAULT`` is a test hook: ``RANK:KIND:POSITION[,...]`` plants failures for the failure
tests and for trying those paths by hand (``Fault``), and ``RANK:KIND:LAYER.MODULE`` plants a bug that
exists only under parallelism, in one rank's shard of a weight once transformers has sharded it
(``ShardFault``), so the planted-bug tests can check that the tool names the layer, the field and the
rank.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
from dataclasses import dataclass

FAULT_ENV = "KESTREL_DIST_FAULT"
FAULT_KINDS = ("exit", "raise", "hang", "shape", "replica")
SHARD_FAULTS = ("scale_shard", "swap_shards", "ep_misplace")
EXIT_CODE = 3  # the planted exit's code: the engine's message shows it
SHARD_SCALE = 1.01  # scale_shard's factor: far above rounding (NMSE 1e-4 on the shard), small enough to look real

# modules whose plan style decides a key's layout, as transformers' plans name them (hf_dist.LAYOUT reads
# the styles back); the router (mlp.gate), the norms and the embedding's output are replicated
PLANNED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.experts",
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
    store: str                # the file store torch.distributed meets in
    timeout_s: float          # collectives give up after this (the engine kills the group first)


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


def plan_styles(model, job: RankJob) -> dict[str, str]:
    """PLANNED module -> the style transformers applied to it on this rank ("" where none)."""
    if job.world_size == 1:
        return dict.fromkeys(PLANNED, "")
    tp = {k.removeprefix("model.layers.*."): v for k, v in (model.tp_plan or {}).items()}
    ep = {k.removeprefix("model.layers.*."): v for k, v in (model.ep_plan or {}).items()} if job.ep else {}
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
        from transformers import AutoModelForCausalLM

        from .hf import _quiet
        from .hf_hooks import Capture, attention_name

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
        kwargs = dict(dtype=getattr(torch, job.settings["dtype"]),
                      attn_implementation=job.settings["attn_implementation"], num_hidden_layers=job.n_layers)
        if job.world_size > 1:
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(
                tp_size=job.world_size, **({"ep_size": job.world_size, "ep_implementation": job.ep_impl}
                                           if job.ep else {}))
        with _quiet():
            model = AutoModelForCausalLM.from_pretrained(job.model_dir, **kwargs)
        if job.world_size == 1:
            model = model.to(device if cuda else "cpu")
        self.model = model.eval()
        model.set_attn_implementation(attention_name(model, job.settings["attn_implementation"]))
        self.capture = Capture(model, job.kv, job.deep)
        self.partials = PartialSums(model) if job.world_size > 1 else None
        self.cache = None

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

    def step(self, ids: list[int], pos0: int) -> dict:
        from transformers import DynamicCache

        from .hf import _quiet, _torch_flags

        if pos0 == 0:  # a new run
            self.cache = DynamicCache(config=self.model.config)
            self.capture.begin(None)
        with _torch_flags(self.job.settings), _quiet():
            out = self.capture.step(ids, pos0, self.cache, raw=True)
        partial = self.partials.take(pos0, len(ids)) if self.partials is not None else [{} for _ in ids]
        return {"raw": out.raw, "partial": partial}


def _local_rows(w) -> int:
    """A weight's output rows on this rank (a DTensor's local shard)."""
    return (w.to_local() if hasattr(w, "to_local") else w).shape[0]


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def serve() -> None:
    from .child_main import _safe_path

    _safe_path()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what transformers and torch print goes to stderr, never into the message stream
    commands = sys.stdin.buffer
    rank = int(os.environ["RANK"])

    def send(*msg):
        pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()

    try:
        faults = faults_from(os.environ.get(FAULT_ENV))
        job: RankJob = pickle.load(commands)
        r = Rank(job, rank)
        for f in faults:
            if isinstance(f, ShardFault):
                f.plant(r.model, rank, job.world_size)
        send("ready", r.info())
        while True:
            _, ids, pos0 = pickle.load(commands)  # ("step", ids, pos0); the engine ends a rank by its group
            planted = [f for f in faults if isinstance(f, Fault) and f.due(rank, pos0, len(ids))]
            for f in planted:
                f.before()
            send("started", pos0)
            payload = r.step(ids, pos0)
            for f in planted:
                f.after(payload, pos0)
            send("out", pos0, payload)
    except EOFError:
        return  # the engine closed our stdin: nothing to tell
    except Exception as e:
        send("failed", _line(e))
        sys.exit(1)


if __name__ == "__main__":
    serve()

"""The hf engine: HF transformers (torch) in-process as a run source.

transformers' own Qwen3 / Qwen3-MoE code runs the decode; engines/hf_hooks.py
reads every probe key through public hooks (module hooks and a wrapper in
transformers' attention registry), so the subject is HF exactly as users run
it. The keys mean what the reference's mean (docs/engines-hf.md): k/ks/v/vs
are what our cache would hold from HF's K and V in the reference's KV format.

`HFFamily` is what this engine and hf-dist (engines/hf_dist.py) share; each states its name, its option
table (engines/hf_options.py), its capabilities and its run, which feeds the engines' decode loop
(engines/decode.py) with its step.
"""
from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..trace.keys import DEEP_FIELDS, FIELDS
from ..trace.rawstore import RawStore
from ..trace.run import Trace
from .base import Capabilities, Engine, EngineFailed, EngineSpec, RunRequest, Toggle
from .decode import decode_loop
from .hf_options import HF, OptionTable
from .hf_torch import first_line, load_model, needs_torch, quiet, torch_flags
from .schedule import parse_schedule


class HFFamily(Engine):
    """What the hf engines share: the checkpoint (an HF directory, or the embedded model exported as one),
    its config's checks, the keys, the option table and a run's settings. An engine of the family states
    its name, its table, its capabilities and how it runs (hf: in this process; hf-dist: in its ranks)."""

    table: OptionTable

    def __init__(self, model_dir: str | None, model, options: Mapping[str, object],
                 toggles: tuple[Toggle, ...] | None, kv: str = "q8", deep: bool = False):
        self.options, self.kv, self.deep, self.ours = dict(options), kv, deep, model
        self.fields = frozenset(("emb", "logits", *FIELDS, *(DEEP_FIELDS if deep else ())))
        self._tmp = None
        self.model_dir = self._resolve(model_dir)
        self._read_config()
        self.toggles = toggles if toggles is not None else self.default_toggles()

    def default_toggles(self) -> tuple[Toggle, ...]:
        return self.table.default_toggles(self.options, moe=self.moe)

    def settings(self, values: Mapping[str, str]) -> dict[str, object]:
        """Each option's value for a run: a toggle's value where one sets it, else the option's."""
        return self.table.settings(self.options, self.toggles, values)

    def versions(self) -> str:
        import torch
        import transformers

        return f"transformers {transformers.__version__}, torch {torch.__version__}"

    # -- the checkpoint
    def _resolve(self, model_dir: str | None) -> str:
        if model_dir is None or str(model_dir) == "default":
            if self.ours is None:
                raise UsageError(f"{self.name} engine: no model directory and no model to export; pass an HF"
                                 f" directory")
            from ..model.hf_export import to_hf_model

            # the embedded default as an HF checkpoint, so every dtype loads through from_pretrained
            self._tmp = tempfile.TemporaryDirectory(prefix="kestrel-hf-")
            with quiet():
                to_hf_model(self.ours).save_pretrained(self._tmp.name)
            return self._tmp.name
        if not Path(model_dir).is_dir():
            raise UsageError(f"{self.name} engine: {model_dir}: not a directory; it takes an HF model directory"
                             f" (config.json + *.safetensors)")
        return str(model_dir)

    def _read_config(self):
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(self.model_dir)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a bad dir
            raise UsageError(f"{self.name} engine: transformers cannot read {self.model_dir}: {first_line(e)}"
                             ) from None
        if cfg.model_type not in ("qwen3", "qwen3_moe"):
            raise UsageError(f"{self.name} engine: {self.model_dir} is a {cfg.model_type!r} model; the hooks know"
                             f" qwen3 and qwen3_moe")
        self.moe = cfg.model_type == "qwen3_moe"
        self.heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
        self.n_experts = getattr(cfg, "num_experts", 0) or 0
        self.n_layers = cfg.num_hidden_layers
        if self.ours is not None and self.ours.cfg.n_layers < self.n_layers:
            self.n_layers = self.ours.cfg.n_layers  # the reference keeps the first n layers: so does HF

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def make_family_engine(cls: type[HFFamily], spec: EngineSpec, model, kv: str, deep: bool) -> HFFamily:
    """An engine of the hf family from a spec: its options and a profile's toggles checked by its table."""
    needs_torch(cls.name)
    if kv not in ("q8", "f32"):
        raise UsageError(f"{cls.name} engine: kv {kv!r}: choose from q8, f32")
    options = cls.table.parse(spec.options)
    toggles = cls.table.check_toggles(tuple(spec.toggles)) if spec.toggles is not None else None
    return cls(spec.model, model, options, toggles, kv=kv, deep=deep)


def make_hf_engine(spec: EngineSpec, model=None, kv: str = "q8", deep: bool = False) -> "HFEngine":
    """The engine table's factory (registry.py)."""
    return make_family_engine(HFEngine, spec, model, kv, deep)


class HFEngine(HFFamily):
    name = "hf"
    table = HF

    def __init__(self, model_dir: str | None, model, options: Mapping[str, object],
                 toggles: tuple[Toggle, ...] | None, kv: str = "q8", deep: bool = False):
        super().__init__(model_dir, model, options, toggles, kv=kv, deep=deep)
        # K/V rows of another engine go into HF's cache only as they are: f32 rows
        self.caps = Capabilities(prefill_from=kv == "f32", forcing=True, isolate=True, logits=True, raw=True,
                                 graft=True)
        self._loaded = None  # ((dtype, attn, device), torch model, Capture)

    @property
    def device_name(self) -> str:
        return f"{self.options['device']} ({self.versions()})"

    def torch_model(self, values: Mapping[str, str] | None = None):
        """The loaded torch model for these toggle values (cached; reloaded when dtype, attention or
        device change). Tests plant bugs in it; a reload drops them."""
        return self._load(self.settings(values or {}))[0]

    def capture(self, values: Mapping[str, str] | None = None):
        """The hooks on that model (engines/hf_hooks.Capture): one forward at a time, for benchmarks."""
        return self._load(self.settings(values or {}))[1]

    def load_torch_model(self, s: Mapping[str, object]):
        """A fresh torch model of the checkpoint for settings ``s`` (not this engine's cached one)."""
        try:
            return load_model(self.model_dir, s, self.n_layers, s["device"])
        except Exception as e:
            raise UsageError(f"hf engine: transformers cannot load {self.model_dir}: {first_line(e)}") from None

    def _load(self, s: Mapping[str, object]):
        from .hf_hooks import Capture

        key = (s["dtype"], s["attn_implementation"], s["device"])
        if self._loaded is not None and self._loaded[0] == key:
            return self._loaded[1:]
        self._drop()
        m = self.load_torch_model(s)
        cap = Capture(m, self.kv, self.deep)
        self._loaded = (key, m, cap)
        return m, cap

    def _drop(self):
        if self._loaded is not None:
            self._loaded[2].remove()
            self._loaded = None

    def close(self) -> None:
        self._drop()
        super().close()

    def prefill_problem(self, reference: Engine) -> str | None:
        if self.kv != "f32":
            return "hf takes the reference's KV rows only with kv f32 (q8 rows are not what HF's cache holds)"
        if not reference.caps.raw:
            return f"hf needs the reference's raw K/V rows, and {reference.name} reports none"
        return None

    # -- a run
    def run(self, req: RunRequest):
        from transformers import DynamicCache

        s = self.settings(req.values)
        model, cap = self._load(s)
        trace = Trace(backend=self.describe(req.values), prompt=list(req.prompt), store=RawStore())
        if req.feed_from is not None and any(p.raw is None for p in req.feed_from.positions):
            raise UsageError("hf engine: isolate needs the reference's raw buffers (its run kept none)")
        with torch_flags(s), quiet():
            try:
                cap.begin(req.feed_from, graft=req.graft)
            except ValueError as e:
                raise UsageError(f"hf engine: {e} (docs/engines-hf.md: where a graft goes)") from None
            try:
                cache = [DynamicCache(config=model.config)]

                def restart():  # the rollout a scoring schedule runs first: its cache goes
                    cache[0] = DynamicCache(config=model.config)

                def step(ids: list[int], pos0: int):
                    try:
                        return cap.step(ids, pos0, cache[0], raw=req.raw)
                    except (UsageError, KeyboardInterrupt):
                        raise
                    except Exception as e:  # a torch / transformers failure mid-run: the positions so far stand
                        raise EngineFailed(f"hf engine failed at position {pos0}: {type(e).__name__}:"
                                           f" {first_line(e)}", partial=trace) from e

                take = (lambda src: _load_kv(cache[0], src, cap)) if self.kv == "f32" else None
                return decode_loop(req, trace, step, token_prefill=s["prefill"] == "token", take_prefill=take,
                                   schedule=parse_schedule(s["schedule"]), restart=restart)
            finally:
                cap.end()


def _load_kv(cache, src, cap) -> None:
    """The reference's prompt K/V rows (f32 cache: k = K after RoPE, v = V) into HF's DynamicCache."""
    import torch

    if any(p.raw is None for p in src):
        raise UsageError("hf engine: the reference prefill has no raw buffers to take K/V rows from")
    p0 = next(cap.model.parameters())
    for li in range(cap.shape.n_layers):
        k, v = (np.stack([np.asarray(p.raw[f"t{p.t}_l{li}_{f}"], np.float32) for p in src], axis=1)[None]
                for f in ("k", "v"))  # [1, n_kv, P, hd]
        cache.update(torch.from_numpy(k).to(p0.device, p0.dtype), torch.from_numpy(v).to(p0.device, p0.dtype), li)

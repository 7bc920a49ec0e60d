"""The hf engine: HF transformers (torch) in-process as a run source.

transformers' own Qwen3 / Qwen3-MoE code runs the decode; engines/hf_hooks.py
reads every probe key through public hooks (module hooks and a wrapper in
transformers' attention registry), so the subject is HF exactly as users run
it. The keys mean what the reference's mean (docs/engines-hf.md): k/ks/v/vs
are what our cache would hold from HF's K and V in the reference's KV format.
"""
from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..trace.keys import DEEP_FIELDS, FIELDS
from .base import Capabilities, Engine, EngineFailed, EngineSpec, RunRequest, Toggle, check_toggle_keys

NEEDS = "hf engine needs transformers and torch: pip install -e '.[test]'"

# option -> allowed values, the default first
OPTIONS: dict[str, tuple[str, ...]] = {
    "attn_implementation": ("eager", "sdpa"),
    "dtype": ("float32", "bfloat16", "float16"),
    "prefill": ("batched", "token"),
    "device": ("cpu", "cuda"),
    "tf32": ("on", "off"),
    "deterministic": ("off", "on"),
}
EXACT = {"attn_implementation": "eager", "prefill": "token", "tf32": "off", "deterministic": "on"}
OWNS = {"attn_implementation": ("attn",), "prefill": ("k", "attn"), "tf32": ("kraw", "attn", "x"),
        "deterministic": ("attn", "x")}
HELP = {
    "attn_implementation": "transformers' attention function: eager (matmul + softmax) or sdpa",
    "dtype": "the torch dtype the checkpoint is loaded in",
    "prefill": "the prompt as one forward (batched) or one token at a time",
    "device": "where the model runs",
    "tf32": "TF32 matmuls and convolutions on CUDA",
    "deterministic": "torch.use_deterministic_algorithms",
}


def _imports():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError(NEEDS) from None


def _cuda_ok() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_value(name: str, value: object, where: str = "option") -> str:
    if name not in OPTIONS:
        raise UsageError(f"hf engine: unknown {where} {name!r}; choose from {', '.join(OPTIONS)}")
    if not isinstance(value, str) or value not in OPTIONS[name]:
        raise UsageError(f"hf engine: {name}={value!r} is not allowed; choose from {'|'.join(OPTIONS[name])}")
    if name == "device" and value == "cuda" and not _cuda_ok():
        raise UsageError("hf engine: device=cuda, but torch sees no CUDA device; use device=cpu")
    return value


def parse_options(options: Mapping[str, object]) -> dict[str, str]:
    """Every option's value (the given ones validated, the rest their defaults)."""
    out = {name: values[0] for name, values in OPTIONS.items()}
    for name, value in options.items():
        out[str(name)] = _check_value(str(name), value)
    return out


def default_toggles(opts: Mapping[str, str]) -> tuple[Toggle, ...]:
    """One toggle per option, values[0] = the option's value; device only where CUDA is."""
    out = []
    for name, values in OPTIONS.items():
        if name == "device" and not _cuda_ok():
            continue
        first = opts[name]
        out.append(Toggle(name, (first, *(v for v in values if v != first)), EXACT.get(name),
                          OWNS.get(name, ()), HELP[name], key=name))
    return tuple(out)


def check_toggles(toggles: tuple[Toggle, ...]) -> tuple[Toggle, ...]:
    check_toggle_keys("hf", toggles, lambda key, v: _check_value(key, v, where="toggle key"))
    return toggles


def make_hf_engine(spec: EngineSpec, model=None, kv: str = "q8", deep: bool = False) -> "HFEngine":
    _imports()
    if kv not in ("q8", "f32"):
        raise UsageError(f"hf engine: kv {kv!r}: choose from q8, f32")
    opts = parse_options(spec.options)
    toggles = check_toggles(tuple(spec.toggles)) if spec.toggles is not None else default_toggles(opts)
    return HFEngine(spec.model, model, opts, toggles, kv=kv, deep=deep)


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model_dir: str | None, model, options: Mapping[str, str], toggles: tuple[Toggle, ...],
                 kv: str = "q8", deep: bool = False):
        self.options, self.toggles, self.kv, self.deep = dict(options), toggles, kv, deep
        self.ours = model
        self.fields = frozenset(("emb", "logits", *FIELDS, *(DEEP_FIELDS if deep else ())))
        # K/V rows of another engine go into HF's cache only as they are: f32 rows
        self.caps = Capabilities(prefill_from=kv == "f32", forcing=True, isolate=True, logits=True, raw=True,
                                 graft=True)
        self._tmp = None
        self.model_dir = self._resolve(model_dir)
        self._check_config()
        self._loaded = None  # ((dtype, attn, device), torch model, Capture)

    @property
    def device_name(self) -> str:
        import torch
        import transformers

        return f"{self.options['device']} (transformers {transformers.__version__}, torch {torch.__version__})"

    # -- the checkpoint
    def _resolve(self, model_dir: str | None) -> str:
        if model_dir is None or str(model_dir) == "default":
            if self.ours is None:
                raise UsageError("hf engine: no model directory and no model to export; pass an HF directory")
            from ..model.hf_export import to_hf_model

            # the embedded default as an HF checkpoint, so every dtype loads through from_pretrained
            self._tmp = tempfile.TemporaryDirectory(prefix="kestrel-hf-")
            with _quiet():
                to_hf_model(self.ours).save_pretrained(self._tmp.name)
            return self._tmp.name
        if not Path(model_dir).is_dir():
            raise UsageError(f"hf engine: {model_dir}: not a directory; it takes an HF model directory"
                             f" (config.json + *.safetensors)")
        return str(model_dir)

    def _check_config(self):
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(self.model_dir)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a bad dir
            raise UsageError(f"hf engine: transformers cannot read {self.model_dir}: {_line(e)}") from None
        if cfg.model_type not in ("qwen3", "qwen3_moe"):
            raise UsageError(f"hf engine: {self.model_dir} is a {cfg.model_type!r} model; the hooks know"
                             f" qwen3 and qwen3_moe")
        self.n_layers = cfg.num_hidden_layers
        if self.ours is not None and self.ours.cfg.n_layers < self.n_layers:
            self.n_layers = self.ours.cfg.n_layers  # the reference keeps the first n layers: so does HF

    def settings(self, values: Mapping[str, str]) -> dict[str, str]:
        """Each option's value for a run: a toggle's value where one sets it, else the option's."""
        out = dict(self.options)
        for t in self.toggles:
            key = t.key or t.name
            out[key] = _check_value(key, values.get(t.name, t.default), where="toggle key")
        return out

    def torch_model(self, values: Mapping[str, str] | None = None):
        """The loaded torch model for these toggle values (cached; reloaded when dtype, attention or
        device change). Tests plant bugs in it; a reload drops them."""
        return self._load(self.settings(values or {}))[0]

    def capture(self, values: Mapping[str, str] | None = None):
        """The hooks on that model (engines/hf_hooks.Capture): one forward at a time, for benchmarks."""
        return self._load(self.settings(values or {}))[1]

    def _load(self, s: Mapping[str, str]):
        import torch
        from transformers import AutoModelForCausalLM

        from .hf_hooks import Capture, attention_name

        key = (s["dtype"], s["attn_implementation"], s["device"])
        if self._loaded is not None and self._loaded[0] == key:
            return self._loaded[1:]
        self._drop()
        try:
            with _quiet():
                m = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, s["dtype"]),
                                                         attn_implementation=s["attn_implementation"],
                                                         num_hidden_layers=self.n_layers)
        except Exception as e:
            raise UsageError(f"hf engine: transformers cannot load {self.model_dir}: {_line(e)}") from None
        m = m.to(s["device"]).eval()
        m.set_attn_implementation(attention_name(m, s["attn_implementation"]))
        cap = Capture(m, self.kv, self.deep)
        self._loaded = (key, m, cap)
        return m, cap

    def _drop(self):
        if self._loaded is not None:
            self._loaded[2].remove()
            self._loaded = None

    def close(self) -> None:
        self._drop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def prefill_problem(self, reference: Engine) -> str | None:
        if self.kv != "f32":
            return "hf takes the reference's KV rows only with kv f32 (q8 rows are not what HF's cache holds)"
        if not reference.caps.raw:
            return f"hf needs the reference's raw K/V rows, and {reference.name} reports none"
        return None

    # -- a run
    def run(self, req: RunRequest):
        from ..trace.run import Cancelled, Position, Trace
        from ..trace.rawstore import RawStore

        if not req.prompt:
            raise ValueError("the prompt is empty; give at least one token")
        s = self.settings(req.values)
        model, cap = self._load(s)
        P = len(req.prompt)
        store = RawStore()
        trace = Trace(backend=self.describe(req.values), prompt=list(req.prompt), store=store)

        def check():
            if req.cancel is not None and req.cancel.is_set():
                raise Cancelled()

        def record(out, pos0: int, tokens: list[int]):
            for m, tok in enumerate(tokens):
                p = Position(t=pos0 + m, token=tok, prompt=pos0 + m < P, hashes=out.hashes[m],
                             raw=store.keep(out.raw[m]) if out.raw else None,
                             logits=np.ascontiguousarray(out.logits[m]))
                trace.positions.append(p)
                if req.on_position:
                    req.on_position(p)

        if req.feed_from is not None and any(p.raw is None for p in req.feed_from.positions):
            raise UsageError("hf engine: isolate needs the reference's raw buffers (its run kept none)")
        from transformers import DynamicCache

        with _torch_flags(s), _quiet():
            try:
                cap.begin(req.feed_from, graft=req.graft)
            except ValueError as e:
                raise UsageError(f"hf engine: {e} (docs/engines-hf.md: where a graft goes)") from None
            try:
                cache = DynamicCache(config=model.config)
                check()
                if req.prefill_from is not None and self.kv == "f32":
                    src = req.prefill_from.positions[:P]
                    _load_kv(cache, src, cap)
                    for p in src:
                        trace.positions.append(p)
                        if req.on_position:
                            req.on_position(p)
                elif s["prefill"] == "batched":
                    record(_step(cap, req.prompt, 0, cache, req.raw, trace), 0, list(req.prompt))
                else:
                    for t, tok in enumerate(req.prompt):
                        if t:
                            check()
                        record(_step(cap, [tok], t, cache, req.raw, trace), t, [tok])
                for i in range(req.n_tokens):
                    check()
                    if req.stop is not None and req.stop():
                        break
                    t = P + i
                    tok = req.forced[i] if req.forced is not None else trace.positions[-1].top1
                    record(_step(cap, [tok], t, cache, req.raw, trace), t, [tok])
            finally:
                cap.end()
        return trace


def _step(cap, ids, pos0, cache, raw, trace):
    try:
        return cap.step(ids, pos0, cache, raw=raw)
    except (UsageError, KeyboardInterrupt):
        raise
    except Exception as e:  # a torch / transformers failure mid-run: the positions so far stand
        raise EngineFailed(f"hf engine failed at position {pos0}: {type(e).__name__}: {_line(e)}",
                           partial=trace) from e


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


@contextlib.contextmanager
def _torch_flags(s: Mapping[str, str]):
    """TF32 and deterministic algorithms as the run asks, restored after it."""
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    tf32 = s["tf32"] == "on"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.use_deterministic_algorithms(s["deterministic"] == "on")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])


@contextlib.contextmanager
def _quiet():
    """transformers' warnings and progress bars would land on the TUI's terminal."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__

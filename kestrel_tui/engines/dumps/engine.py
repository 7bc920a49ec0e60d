"""The vllm-dump and sglang-dump engines: a serving engine's recorded run as a subject (or reference).

Nothing runs: the engine reads the folder the serving engine wrote and hands the session the
positions of the request whose tokens are the session's (the prompt, then the forced tokens), in
our keys. Two names rather than one engine with a format option: each reads the dumps of one
engine and maps module names from that engine's source, and the name says in every header which
engine's numbers are on the screen. sglang-dump reads both of SGLang's formats (`format`: auto
tells them apart by the folder's contents).
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import UsageError
from ...text import inert
from ..base import Capabilities, Engine, EngineSpec, RunRequest
from .names import FIELDS as MAPPED

OPTIONS = {
    "folder": "the folder the engine dumped into (vLLM: VLLM_DEBUG_TENSOR_DUMP_OUTPUT_FOLDER; SGLang legacy:"
              " --debug-tensor-dump-output-folder; SGLang dumper: the experiment folder under DUMPER_DIR)",
    "format": "sglang-dump only: legacy, dumper or auto (default: auto, from the folder's contents)",
    "request": "which of the dumped requests with the session's tokens to read (default 0: the first)",
    "name": "the engine's name in headers (default: the engine's name and the folder's)",
}
FORMATS = {"vllm-dump": ("passes",), "sglang-dump": ("auto", "legacy", "dumper")}


@dataclass(frozen=True)
class DumpConfig:
    engine: str
    folder: Path
    format: str
    request: int
    name: str


def parse_options(engine: str, options: Mapping[str, object]) -> DumpConfig:
    def bad(msg: str) -> UsageError:
        return UsageError(f"{engine} engine: {msg}")

    allowed = [k for k in OPTIONS if k != "format" or engine == "sglang-dump"]
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise bad(f"unknown option {inert(unknown[0], 40)!r}; the options are {', '.join(allowed)}")
    folder = options.get("folder")
    if not isinstance(folder, str) or not folder:
        raise bad("needs `folder`: the folder the engine dumped into")
    fmt = options.get("format", FORMATS[engine][0])
    if fmt not in FORMATS[engine]:
        raise bad(f"format {inert(repr(fmt), 40)}: choose from {', '.join(FORMATS[engine])}")
    request = options.get("request", 0)
    if isinstance(request, bool) or not isinstance(request, int) or request < 0:
        raise bad(f"request {inert(repr(request), 40)}: expected a whole number >= 0")
    name = options.get("name", f"{engine} {Path(folder).name}")
    if not isinstance(name, str) or not name.strip():
        raise bad(f"name {inert(repr(name), 40)}: expected a non-empty string")
    return DumpConfig(engine, Path(folder), fmt, request, name)


def open_source(engine: str, folder: Path, fmt: str = "auto", n_kv: int | None = None,
                n_layers: int | None = None):
    """The reader of a dump folder: vLLM's or SGLang's per-rank pass folders, or SGLang's dumper files."""
    from .passes import PassFolders
    from .sglang_dumper import DumperFolder, holds_records

    if engine == "vllm-dump":
        return PassFolders(folder, "vLLM", n_kv, n_layers)
    if fmt == "auto":
        fmt = "dumper" if holds_records(folder) else "legacy"
    if fmt == "dumper":
        return DumperFolder(folder, n_kv, n_layers)
    return PassFolders(folder, "SGLang", n_kv, n_layers)


class DumpEngine(Engine):
    def __init__(self, cfg: DumpConfig, model=None, kv: str = "f32", deep: bool = False):
        from ...trace.keys import DEEP_FIELDS, FIELDS

        self.cfg, self.name, self.kv, self.deep = cfg, cfg.name, kv, deep
        self.cfg_model = model.cfg if model is not None else None
        made = MAPPED | {"k", "ks", "vs"}
        if cfg.engine == "vllm-dump":
            made -= {"topk", "topw"}  # vLLM routes inside FusedMoE: no module gives them
        self.fields = frozenset(f for f in ("emb", "logits", *FIELDS, *(DEEP_FIELDS if deep else ())) if f in made)
        self.caps = Capabilities(prefill_from=False, forcing=False, isolate=False, logits=True, raw=True,
                                 formats=False)
        self.toggles = ()
        self.source = open_source(cfg.engine, cfg.folder, cfg.format, self._n_kv(), self._n_layers())

    def _n_kv(self):
        return self.cfg_model.n_kv_heads if self.cfg_model is not None else None

    def _n_layers(self):
        return self.cfg_model.n_layers if self.cfg_model is not None else None

    @property
    def device_name(self) -> str:
        return self.source.label

    def prefill_problem(self, reference: Engine) -> str | None:
        return f"{self.name} is a recorded run: it cannot take another engine's KV rows"

    def run(self, req: RunRequest):
        from .build import read_trace

        forced = list(itertools.takewhile(lambda t: t >= 0, req.forced[:req.n_tokens])) if req.forced else []
        want = list(req.prompt) + forced  # a reference that reported no token (-1) is followed that far
        return read_trace(self.source, want=want, request=self.cfg.request, n_prompt=len(req.prompt),
                          n_positions=len(req.prompt) + req.n_tokens, kv=self.kv, deep=self.deep,
                          n_layers=self._n_layers(), name=self.describe(req.values), raw=req.raw,
                          n_heads=self.cfg_model.n_heads if self.cfg_model is not None else None,
                          on_position=req.on_position, cancel=req.cancel, stop=req.stop)


def make_dump_engine(spec: EngineSpec, model=None, kv: str = "f32", deep: bool = False) -> DumpEngine:
    """kv and deep are the reference's: k/ks/v/vs are made in its KV format, the deep keys only if asked."""
    if spec.toggles:
        raise UsageError(f"{spec.engine} engine: a recorded run has nothing to switch; remove its [[toggle]] entries")
    return DumpEngine(parse_options(spec.engine, spec.options or {}), model, kv=kv, deep=deep)


def dump_factory(spec, model, kv="q8", deep=False, **_):
    """The engine table's factory of vllm-dump and sglang-dump (the spec names the engine)."""
    return make_dump_engine(spec, model, kv=kv, deep=deep)

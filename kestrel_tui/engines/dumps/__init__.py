"""Readers of the serving engines' own tensor dumps (vLLM, SGLang) as engines, and for `diff`.

docs/engines-serving-dumps.md is the user's guide. The modules, from the files up:
load.py (weights_only loading), passes.py (per-rank pass folders: vLLM, SGLang legacy),
sglang_dumper.py (SGLang's dumper files), names.py (module names -> keys, per their Qwen3 sources),
shards.py (reassembly, partial sums, dims), steps.py (one forward), tokens.py (which rows are the
request), build.py (the Trace), engine.py (the engines).
"""
from __future__ import annotations

from pathlib import Path

from .build import DumpTrace

__all__ = ["DumpTrace", "detect_engine", "read_folder"]


def detect_engine(path: str | Path) -> str | None:
    """vllm-dump / sglang-dump for a folder that holds such a dump, None otherwise. The per-rank pass
    folders are the same for vLLM and SGLang's legacy dump: SGLang's also dumps seq_lens."""
    from .passes import PASS_FILE, RANK_DIR, SEQ_LENS, load_pass
    from .sglang_dumper import holds_records

    p = Path(path)
    if not p.is_dir():
        return None
    if holds_records(p):
        return "sglang-dump"
    entries = sorted(p.iterdir())
    ranks = [e for e in entries if e.is_dir() and RANK_DIR.fullmatch(e.name)]
    if not ranks:
        return None
    first = next((f for f in sorted(ranks[0].iterdir()) if PASS_FILE.fullmatch(f.name)), None)
    if first is None:
        return "vllm-dump"
    return "sglang-dump" if SEQ_LENS in load_pass(first) else "vllm-dump"


def read_folder(path: str | Path, *, tokens: list[int] | None = None, request: int = 0, kv: str = "f32",
                deep: bool = True, engine: str | None = None) -> DumpTrace:
    """A dump folder as a Trace (the `diff` command's side A or B).

    ``tokens``: the other side's consumed tokens, so the request with those tokens is read (a batch
    of several requests against a single-request reference); None: the ``request``-th request of the
    dump. A UsageError (one line) for a folder that is not a dump or cannot be read."""
    from ...errors import UsageError
    from ...text import inert
    from .build import read_trace
    from .engine import open_source

    engine = engine or detect_engine(path)
    if engine is None:
        raise UsageError(f"{inert(str(path))}: not a vLLM or SGLang dump folder (no TP*_PP*_Rank*_pid* folders,"
                         f" no dumper files); name the folder the engine dumped into")
    source = open_source(engine, Path(path))
    return read_trace(source, want=tokens, request=request, kv=kv, deep=deep, name=f"{engine} {Path(path).name}")

"""The toy process engine (tests/engines/toy_engine.py) as the process-engine tests drive it."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kestrel_tui.engines.build import make_backend
from kestrel_tui.engines.builtin import run_decode
from kestrel_tui.model.hf import load_model

TOY = str(Path(__file__).resolve().parent / "engines" / "toy_engine.py")
PROMPT = [1, 1775, 1501]
N = 3  # positions 0..5: three prompt, three decoded


def toy_options(*extra, raw: bool, forced: bool = True, **options) -> dict:
    """The process engine's options for the toy with ``extra`` arguments (test knobs)."""
    cmd = [sys.executable, TOY, "--prompt-ids", "{prompt_ids}", "--tokens", "{n_tokens}", *extra]
    if forced:
        cmd += ["--forced-ids", "{forced_ids}"]
    if raw:
        cmd += ["--raw", "{raw}"]
    return {"command": cmd, "dump_env": "TOY_DUMP", **options}


@pytest.fixture(scope="module")
def model():
    return load_model(None, n_layers=2)


@pytest.fixture(scope="module")
def gguf(model, tmp_path_factory):
    """The 2-layer model as a GGUF file: what the process engines' profiles name as their model."""
    from kestrel_tui.model.gguf import write_gguf

    path = tmp_path_factory.mktemp("model") / "tiny2.gguf"
    write_gguf(model, path)
    return path


def gone(pid: int) -> bool:
    """Dead or a zombie (a reparented grandchild waits for init to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def ref(model):
    """The cpu reference of the toy's prompt: what the toy with every op exact must equal."""
    return run_decode(make_backend("cpu", model), PROMPT, N)

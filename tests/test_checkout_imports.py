"""A checkout shadows no module of a dependency.

`python -m pytest` and `python -m kestrel_tui.cli` put the checkout's root first on sys.path, so a
top-level folder that is a package hides any installed package of the same name. transformers (5.25
and newer) imports Hugging Face's `kernels` package when it is installed; our top-level kernels/ is a
data folder read by path, and must stay one.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _from_root(code: str) -> subprocess.CompletedProcess:
    # -c puts the working directory first on sys.path, as `python -m` from the checkout does
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_no_top_level_folder_is_a_package():
    packages = [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    assert packages == ["kestrel_tui"], f"top-level packages besides kestrel_tui shadow installed ones: {packages}"


def test_kernels_is_not_the_checkouts_folder():
    done = _from_root(
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec and spec.origin else '-')\n"
    )
    assert done.returncode == 0, done.stderr
    origin = done.stdout.strip()
    assert not origin.startswith(str(ROOT / "kernels")), f"`import kernels` from the checkout finds {origin}"


def test_transformers_hub_integration_imports_from_the_root():
    pytest.importorskip("transformers")
    done = _from_root(
        "import transformers.integrations.hub_kernels\n"
        "from transformers import AutoModelForCausalLM, Qwen3Config\n"
        "print('ok')\n"
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_cuda_runtime_finds_the_kernel_sources():
    from kestrel_tui.backends.cuda.runtime import KERNEL_DIR, MODULES

    missing = [m for m in MODULES if not (KERNEL_DIR / f"{m}.cu").is_file()]
    assert not missing, f"{KERNEL_DIR}: no {missing}"

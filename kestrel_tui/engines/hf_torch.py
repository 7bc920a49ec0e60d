"""What the hf engines do with torch and transformers alike, in this process or in a rank's.

A checkpoint loaded as the capture wants it (transformers' own model, its attention function wrapped
by engines/hf_hooks.py), transformers kept off the terminal, torch's flags for a run, an exception
said in one line. torch and transformers are imported only when called.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

from ..errors import UsageError


def needs_torch(engine: str) -> None:
    """One line, not a traceback, where torch or transformers is not installed."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError(f"{engine} engine needs transformers and torch: pip install -e '.[test]'") from None


def load_model(model_dir: str, settings: Mapping[str, object], n_layers: int, device: str | None, **extra):
    """transformers' model of the checkpoint in the settings' dtype and attention function, the first
    ``n_layers`` layers, moved to ``device`` (None: where ``extra``'s plan put it), in eval mode, with
    the capture's wrapper as its attention function."""
    import torch
    from transformers import AutoModelForCausalLM

    from .hf_hooks import attention_name

    with quiet():
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, settings["dtype"]),
                                                 attn_implementation=settings["attn_implementation"],
                                                 num_hidden_layers=n_layers, **extra)
    if device is not None:
        m = m.to(device)
    m = m.eval()
    m.set_attn_implementation(attention_name(m, settings["attn_implementation"]))
    return m


@contextlib.contextmanager
def torch_flags(settings: Mapping[str, object]):
    """TF32 and deterministic algorithms as the run asks, restored after it."""
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    tf32 = settings["tf32"] == "on"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.use_deterministic_algorithms(settings["deterministic"] == "on")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])


@contextlib.contextmanager
def quiet():
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


def first_line(e: BaseException) -> str:
    """An exception's message in one line (its type where it has none)."""
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__

"""What the app looks at: a live session (built by a loader, in a worker) or two dump files.

Loading can be slow (a real checkpoint, quantization) or fail (an unreadable
model directory), so the app receives a *loader* and calls it in a thread
worker; a failure becomes a message in the app instead of a traceback before
it starts.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..session.inputs import RunConfig
from ..session.session import Session
from ..errors import UsageError
from ..model.progress import Progress
from ..trace.compare import Tolerance


@dataclass
class Loaded:
    session: Session
    model_label: str  # "synthetic qwen3_moe 48L h256 q4_0, kv q8"
    device: str
    note: str | None = None  # why the subject is not what was asked for (no GPU -> sim)
    tolerance: Tolerance | None = None  # the profile's: the app opens judging DIFF keys with it


# called in a worker with a callback for loading progress (model/progress.py)
Loader = Callable[[Progress], Loaded]


class PromptError(UsageError):
    """The model loaded, but the prompt or the token count does not fit it: the user fixes
    --prompt-ids / --prompt / --tokens, not the model, so the app must say which."""


@dataclass
class LiveSource:
    loader: Loader


@dataclass
class DiffSource:
    path_a: str
    path_b: str
    a: Mapping[str, int] = field(repr=False)
    b: Mapping[str, int] = field(repr=False)


def model_label(session: Session) -> str:
    """The model and the weight/KV formats, claimed only for the sides that run them."""
    m, cfg = session.model, session.model.cfg
    label = f"{m.name} {cfg.arch} {cfg.n_layers}L h{cfg.hidden}"
    takers = [e.name for e in (session.reference_engine, session.subject_engine) if e.caps.formats]
    if not takers:
        return label
    return f"{label} {m.fmt}, kv {session.kv}" + (f" ({takers[0]} only)" if len(takers) == 1 else "")


def loaded(session: Session, note: str | None = None) -> Loaded:
    """Wrap a ready session (tests and scripts inject one)."""
    return Loaded(session, model_label(session), device_of(session.subject), note)


def device_of(subject: str, backend=None) -> str:
    if subject == "cuda":
        # the CUDA backend may name its device; fall back to the backend name
        return str(getattr(backend, "device_name", None) or "cuda")
    if subject == "sim":
        return "CPU (sim: GPU-style fast variants)"
    return str(getattr(backend, "device_name", None) or subject)  # a foreign engine may say where it runs


def pick_subject(requested: str, model) -> tuple[str, str | None, str]:
    """auto -> cuda when a GPU and PyCUDA are usable, else sim with a note saying why."""
    if requested in ("sim", "cuda"):
        return requested, None, device_of(requested)
    from ..engines.build import make_backend

    try:
        backend = make_backend("cuda", model)
    except UsageError as e:
        return "sim", f"using sim: {e}", device_of("sim")
    except Exception as e:  # noqa: BLE001 - auto must never stop the app: a missing module, no driver...
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return "sim", f"using sim: no CUDA subject ({reason})", device_of("sim")
    return "cuda", None, device_of("cuda", backend)


def config_loader(config: RunConfig) -> Loader:
    """The run's settings (session/inputs.py, made by the CLI) -> a loader the app runs in a worker.
    The app opens judging with the config's tolerance (a profile's)."""
    def load(progress: Progress) -> Loaded:
        from ..session.inputs import cache_from_options, engines_from_options, model_from_options, resolve_prompt

        model = model_from_options(config, progress)
        try:
            prompt = resolve_prompt(config, model)
        except UsageError as e:
            raise PromptError(str(e)) from e
        note = None
        requested = config.subject or "auto"
        if config.profile is None and requested in ("auto", "sim", "cuda"):
            subject, note, device = pick_subject(requested, model)
        else:
            subject, device = None, None
        ref, sub = engines_from_options(config, model, subject=subject)
        session = Session(model, prompt, config.tokens, reference=ref, subject=sub, kv=config.kv, deep=config.deep,
                          cache=cache_from_options(config))
        return Loaded(session, model_label(session), device or device_of(sub.name, sub), note, config.tolerance)
    return load


def default_loader(n_layers: int | None = None, tokens: int = 16) -> Loader:
    """The embedded default model on sim: what the palette's recovery command opens."""
    def load(_progress: Progress) -> Loaded:  # generated in about a second: no progress to show
        from ..session.inputs import default_prompt
        from ..model.hf import load_model

        model = load_model(None, n_layers=n_layers)
        return loaded(Session(model, default_prompt(model.cfg.vocab), tokens, subject="sim"))
    return load

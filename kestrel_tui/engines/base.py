"""The engine interface: what a session needs from a reference or a subject.

An engine runs a prompt and N decode positions and returns a `Trace` (per
position: the consumed token, every probe key's hash, raw buffers when it has
them, logits when it has them). It names its toggles — the switches the app
flips and bisection walks — and says which keys it produces and which session
settings it can honour, so a key it never makes reads *missing*, not DIFF, and
a setting it cannot follow is noted instead of silently ignored.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

from ..errors import UsageError
from ..trace.keys import parse_key
from ..trace.run import Position
from .schedule import DECODE, Schedule, parse_schedule

OnPosition = Callable[[Position], None]
# The most CPU threads an engine's option may ask for: far past any machine this runs on, and short of
# what a library would try to start (a typo of 10**6 threads is one line, not a crash).
MOST_THREADS = 1024


@dataclass(frozen=True)
class Toggle:
    """One switch of an engine.

    values[0] is the default. A *binary* toggle has an ``exact`` value (the one
    bisection switches on: the op's exact kernel, eager attention, TF32 off);
    a *list* toggle (exact None) is cycled by the user and never bisected.
    ``owns`` names the probe fields whose first DIFF it can originate, most
    likely owner first; bisection tries owners before the rest. ``key`` is
    what the toggle sets in a foreign engine: an hf option name, or for a
    process an env var (``VLLM_CUDA_L2EXACT``) or a flag (``--cuda``).
    """
    name: str
    values: tuple[str, ...]
    exact: str | None = None
    owns: tuple[str, ...] = ()
    help: str = ""
    key: str | None = None

    def __post_init__(self):
        if len(self.values) < 2 or len(set(self.values)) != len(self.values):
            raise ValueError(f"toggle {self.name!r}: needs at least two distinct values, got {self.values}")
        if self.exact is not None and self.exact not in self.values:
            raise ValueError(f"toggle {self.name!r}: exact value {self.exact!r} is not one of {self.values}")

    @property
    def default(self) -> str:
        return self.values[0]

    @property
    def binary(self) -> bool:
        return self.exact is not None

    @property
    def fast(self) -> str:
        """A binary toggle's other value: its default, unless the default is the exact one."""
        return self.default if self.default != self.exact else next(v for v in self.values if v != self.exact)


def fast_exact(name: str, owns: tuple[str, ...] = (), help: str = "", fast: str = "fast",
               exact: str = "exact") -> Toggle:
    return Toggle(name, (fast, exact), exact, owns, help)


def check_toggle_keys(engine: str, toggles: tuple[Toggle, ...], check: Callable[[str, str], object]) -> set[str]:
    """A profile's toggles for an engine whose toggles set its options: one toggle per option, and
    ``check(option, value)`` (raising a one-line UsageError) on every value. Returns the options set."""
    seen: set[str] = set()
    for t in toggles:
        key = t.key or t.name
        if key in seen:
            raise UsageError(f"{engine} engine: two toggles set option {key!r}")
        seen.add(key)
        for v in t.values:
            check(key, v)
    return seen


@dataclass(frozen=True)
class EngineSpec:
    """An engine as a profile or the command line names it (built by engines.build.make_engine)."""
    engine: str                              # cpu | sim | cuda | hf | process
    model: str | None = None                 # HF dir or .gguf; None: the embedded default
    options: Mapping[str, object] = field(default_factory=dict)  # engine-specific (hf: dtype=..., process: command=...)
    toggles: tuple[Toggle, ...] | None = None  # a profile's toggles; None: the engine's own


@dataclass(frozen=True)
class Capabilities:
    """Which session settings the engine honours; a `False` is noted on each run that asks for it."""
    prefill_from: bool = False  # takes the reference's prompt positions (hashes, raw, KV rows) as its prefill
    forcing: bool = False       # consumes the tokens it is given (teacher forcing) instead of its own top-1
    isolate: bool = False       # feeds every op the reference's inputs
    logits: bool = True         # reports logits (top-1 per position, token flips)
    raw: bool = True            # reports raw buffers (tolerance: close/far)
    formats: bool = True        # runs the session's weight and KV formats (a process runs its own)
    graft: bool = False         # takes the reference's values at chosen keys in place of its own (Graft)


@dataclass(frozen=True)
class Graft:
    """The cause test's change to a run: at these sites (field, layer; layer None for emb and logits),
    at every position, the engine carries on from the reference's value instead of its own. The
    key itself still reports the engine's own value: it is the source, the keys after it the test."""
    reference: object                                  # the reference Trace (with raw buffers)
    sites: frozenset[tuple[str, int | None]]

    def keys(self, t: int) -> list[str]:
        return [f"t{t}_{f}" if layer is None else f"t{t}_l{layer}_{f}" for f, layer in sorted(
            self.sites, key=lambda s: (s[1] is None, s[1] or 0, s[0]))]


@dataclass(frozen=True)
class RunRequest:
    """One run of an engine: what the session asks for."""
    prompt: list[int]
    n_tokens: int
    values: Mapping[str, str]                # every toggle's value
    forced: list[int] | None = None          # teacher forcing: the tokens after the prompt
    prefill_from: object | None = None       # a reference Trace standing in for the prefill
    feed_from: object | None = None          # isolate mode: the reference Trace
    raw: bool = True
    on_position: OnPosition | None = None
    cancel: threading.Event | None = None
    stop: Callable[[], bool] | None = None   # checked between positions (bisection ends early)
    graft: Graft | None = None               # the cause test (session/graft.py); engines with caps.graft

    def __post_init__(self):
        # every engine's one guard: the session refuses an empty prompt in the user's words before this
        if not self.prompt:
            raise ValueError("the prompt is empty; give at least one token")


class Engine:
    """Base class: a name, toggles, capabilities, declared keys, and `run`."""

    name = "?"
    toggles: tuple[Toggle, ...] = ()
    caps = Capabilities()
    # Fields it produces: per-layer fields plus "emb" / "logits"; None: any (the built-ins: all of theirs).
    fields: frozenset[str] | None = None

    def produces(self, key: str) -> bool:
        """Whether this engine makes ``key`` at all (a key it never makes reads missing, not failed)."""
        if self.fields is None:
            return True
        try:
            return parse_key(key).field in self.fields
        except ValueError:
            return True  # a foreign tag it wrote itself

    def toggle(self, name: str) -> Toggle:
        for t in self.toggles:
            if t.name == name:
                return t
        raise KeyError(name)

    def owners(self, field_name: str) -> tuple[str, ...]:
        """The binary toggles that can originate a first DIFF in ``field_name``, most likely first."""
        return tuple(t.name for t in self.toggles if t.binary and field_name in t.owns)

    def settings(self, values: Mapping[str, str]) -> Mapping[str, object]:
        """Each option's value for a run: a toggle's value where one sets it, else the option's (none here:
        the engines with options, hf's and llama.cpp, say theirs)."""
        return {}

    def schedule(self, values: Mapping[str, str]) -> Schedule:
        """The passes a run with these toggle values makes (engines/schedule.py): its settings' schedule;
        decode unless it has one."""
        value = self.settings(values).get("schedule")
        return DECODE if value is None else parse_schedule(value)

    def prefill_problem(self, reference: "Engine") -> str | None:
        """Why this engine cannot take ``reference``'s prefill (None: it can)."""
        if not self.caps.prefill_from:
            return f"{self.name} cannot take another engine's KV rows"
        return None

    def describe(self, values: Mapping[str, str]) -> str:
        """The engine and its non-default toggle values, for headers and dumps."""
        moved = [t for t in self.toggles if t.name in values and values[t.name] != t.default]
        changed = [f"{t.name}={values[t.name]}" for t in moved]
        schedule = self.schedule(values)
        if schedule != DECODE and "schedule" not in {t.key or t.name for t in moved}:  # the side's option
            changed.append(f"schedule={schedule}")
        return f"{self.name} ({', '.join(changed)})" if changed else self.name

    def run(self, req: RunRequest):
        """Run ``req``; returns a trace.run.Trace. Raises trace.run.Cancelled when cancelled,
        errors.UsageError (or EngineFailed) with a one-line message when the engine fails."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds (a torch model, a child process)."""


class EngineFailed(UsageError):
    """The engine stopped (exit code, timeout, an exception inside it). ``partial`` is the Trace
    of the positions that completed, so the app shows them and marks the rest missing. A
    UsageError: where nothing can go on without the run (a headless reference), the message
    is the one line the user gets."""

    def __init__(self, message: str, partial=None):
        super().__init__(message)
        self.partial = partial

"""What a run starts from: one frozen `RunConfig`, built once by the command line from its options
and the profile, and read by everything below it (the commands, the app's loader, the benchmarks).

The command line's own names survive here only in messages, so that an error blames what the user
typed (`--tokens 999`, or the profile's FILE:LINE when the profile set it). Nothing here knows
argparse: `run_config` takes plain values.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..bounds import Number, shown
from ..engines.base import EngineSpec
from ..engines.decoders import CPU_IMPLS
from ..engines.registry import BUILTIN
from ..errors import UsageError
from ..model.progress import Progress
from ..model.weights import Model
from ..trace.compare import Tolerance

DEFAULT_PROMPT_LEN = 16
# What an option left unset means (a profile may set it instead).
DEFAULTS = {"tokens": 16, "weights": "q4_0", "kv": "q8", "deep": False}
DEFAULT_SUBJECT = "sim"  # --subject left out, without a profile
TOKEN_ID = Number(whole=True, lo=0)

@dataclass(frozen=True)
class RunConfig:
    """The run's settings, the command line over the profile over the defaults."""
    model: str | None = None                # an HF directory or a .gguf file; None: the embedded default
    weights: str = DEFAULTS["weights"]
    kv: str = DEFAULTS["kv"]
    deep: bool = DEFAULTS["deep"]
    tokens: int = DEFAULTS["tokens"]
    prompt_ids: tuple[int, ...] | None = None  # checked against the vocabulary once the model is loaded
    prompt: str | None = None               # text for the model's tokenizer; neither: default_prompt
    cpu_impl: str = CPU_IMPLS[0]            # checked where it is read (engines/decoders.cpu_impl)
    cuda_options: str | None = None         # --cuda-options, over a cuda side's own (CudaOptions.of)
    tolerance: Tolerance | None = None      # --tol, else the profile's; None: the command's default
    subject: str | None = None              # --subject without a profile (None: the command's default)
    cache: bool = True                      # the reference cache (session/refcache.py); --no-cache: False
    profile: object | None = None           # engines/profile.Profile
    schedules: tuple[tuple[str, str], ...] = ()  # (side, schedule) given by --schedule / --reference-schedule
    from_profile: frozenset[str] = frozenset()  # the settings the profile gave, for messages

    def origin(self, name: str, flag: str) -> str:
        """Where a setting came from, as the user wrote it: the profile's FILE:LINE or the flag."""
        if self.profile is None or name not in self.from_profile:
            return flag
        line = self.profile.line_of(name)
        return f"{self.profile.path}:{line}: {name}" if line is not None else f"{self.profile.path}: {name}"


def run_config(*, profile: str | None = None, model: str | None = None, weights: str | None = None,
               kv: str | None = None, deep: bool | None = None, tokens: int | None = None,
               prompt_ids: str | None = None, prompt: str | None = None, cpu_impl: str | None = None,
               cuda_options: str | None = None, tol: str | None = None, no_cache: bool = False,
               subject: str | None = None, schedule: str | None = None,
               reference_schedule: str | None = None) -> RunConfig:
    """The command line's options (None: not given) over ``profile``'s settings over DEFAULTS.

    Everything that needs no model is checked here, before anything slow: a bad profile, a prompt
    that is not integers, a misspelt cuda switch or tolerance is one line.
    """
    from ..trace.compare import parse_tolerance

    given = {"model": model, "weights": weights, "kv": kv, "deep": deep, "tokens": tokens,
             "prompt_ids": _parse_ids(prompt_ids) if prompt_ids else None, "prompt": prompt}
    tolerance = parse_tolerance(tol) if tol is not None else None
    loaded, taken = None, set()
    if profile:
        from ..engines.profile import load_profile

        loaded = load_profile(profile, model_override=model)
        given["model"] = loaded.reference.model or loaded.subject.model or loaded.model
        for name in ("tokens", "weights", "kv", "deep"):
            if given[name] is None and getattr(loaded, name) is not None:
                given[name] = getattr(loaded, name)
                taken.add(name)
        if given["prompt_ids"] is None and given["prompt"] is None:
            for name in ("prompt_ids", "prompt"):
                if getattr(loaded, name) is not None:
                    given[name] = getattr(loaded, name)
                    taken.add(name)
                    break
    values = {name: DEFAULTS[name] if given[name] is None and name in DEFAULTS else given[name] for name in given}
    if values["prompt_ids"] is not None:
        values["prompt_ids"] = tuple(values["prompt_ids"])
    if cuda_options:  # a misspelt switch is one line here, before any model (a profile's own: load_profile)
        from ..backends.cuda.options import CudaOptions

        CudaOptions.of(flag=cuda_options)
    from ..engines.schedule import parse_schedule

    schedules = tuple((side, str(parse_schedule(text, flag))) for side, text, flag in (
        ("subject", schedule, "--schedule"), ("reference", reference_schedule, "--reference-schedule"))
        if text is not None)
    return RunConfig(**values, cpu_impl=cpu_impl or CPU_IMPLS[0], cuda_options=cuda_options or None,
                     schedules=schedules,
                     tolerance=tolerance if tolerance is not None else getattr(loaded, "tolerance", None),
                     subject=subject, cache=not no_cache, profile=loaded, from_profile=frozenset(taken))


def _parse_ids(text: str) -> list[int]:
    """Token ids as typed (the vocabulary is checked once the model is loaded)."""
    ids = [tok.strip() for tok in text.split(",") if tok.strip()]
    bad = next((tok for tok in ids if TOKEN_ID.problem(tok) is not None), None)
    if bad is not None:
        raise UsageError(f"--prompt-ids {shown(text)}: {shown(bad)} {TOKEN_ID.problem(bad)}; expected"
                         f" comma-separated token ids (whole numbers >= 0) like 1,2,3")
    return [int(tok) for tok in ids]


def default_prompt(vocab: int, n: int = DEFAULT_PROMPT_LEN) -> list[int]:
    """The embedded model has no tokenizer: a fixed, spread-out id sequence."""
    return [(1 + 7919 * i) % vocab for i in range(n)]


def resolve_prompt(config: RunConfig, model: Model, n_new: int | None = None, flag: str = "--tokens") -> list[int]:
    """The prompt ids, checked with the ``n_new`` positions (default: the config's tokens) that follow.

    ``flag`` names the option that set ``n_new``, so an error blames what the user typed.
    """
    cfg = model.cfg
    if config.prompt_ids is not None:
        ids = list(config.prompt_ids)
        bad = [i for i in ids if not 0 <= i < cfg.vocab]
        if bad:
            where = config.origin("prompt_ids", "--prompt-ids")
            raise UsageError(f"{where}: token id {bad[0]} is outside the vocabulary 0..{cfg.vocab - 1}")
    elif config.prompt is not None:
        if model.tokenizer is None:
            why = f" ({model.notes[0]})" if model.notes else ""
            raise UsageError(f"--prompt needs a model with a tokenizer (tokenizer.json, or a GGUF's own){why};"
                             f" use --prompt-ids for this model")
        ids = model.tokenizer.encode(config.prompt).ids
    else:
        ids = default_prompt(cfg.vocab)
    if not ids:
        raise UsageError("the prompt is empty; give at least one token")
    n = config.tokens if n_new is None else n_new
    if n < 1:
        raise UsageError(f"{flag} {n}: must be at least 1")
    room = cfg.max_positions - len(ids)
    if room < 1:
        prompt = config.origin("prompt_ids" if config.prompt_ids is not None else "prompt", "the prompt")
        raise UsageError(f"{prompt}: {len(ids)} tokens fill the model's context of {cfg.max_positions} positions,"
                         f" and at least one must follow them; shorten it to {cfg.max_positions - 1} tokens or less")
    if n > room:
        where = config.origin("tokens", flag) if flag == "--tokens" else flag
        fix = f"use {flag} {room}" if where == flag else f"set tokens = {room}"
        raise UsageError(f"{where} {n}: the prompt ({len(ids)}) + {n} positions exceed the model's context of"
                         f" {cfg.max_positions}; {fix} or less, or a shorter prompt")
    return ids


def model_from_options(config: RunConfig, progress: Progress | None = None) -> Model:
    """The config's model (None: the embedded default; an HF directory; a .gguf file) in its weights' format."""
    from ..model.hf import load_model

    return load_model(config.model, config.weights, progress=progress)


def cache_from_options(config: RunConfig):
    """The reference cache the config asks for: the user's, unless --no-cache."""
    from .refcache import RefCache

    return RefCache() if config.cache else None


def side_specs(config: RunConfig, subject: str | None = None) -> dict[str, EngineSpec]:
    """Each side's engine: the profile's, or cpu and ``subject`` (the config's --subject, else sim)."""
    profile = config.profile
    if profile is not None:
        specs = {"reference": profile.reference, "subject": profile.subject}
    else:
        name = subject or config.subject or DEFAULT_SUBJECT
        if name == "process":
            raise UsageError("--subject process: a process engine needs its command; name it in a profile"
                             " (--profile FILE, see docs/profiles.md)")
        specs = {"reference": EngineSpec("cpu"), "subject": EngineSpec(name, model=config.model)}
    for side, schedule in config.schedules:  # the flag over the profile's option
        spec = specs[side]
        flag = "--schedule" if side == "subject" else "--reference-schedule"
        if any((t.key or t.name) == "schedule" for t in spec.toggles or ()):
            raise UsageError(f"{flag} {schedule}: the profile's subject has a schedule toggle; flip the toggle,"
                             f" or drop it from the profile")
        specs[side] = replace(spec, options={**spec.options, "schedule": schedule})
    return specs


def engines_from_options(config: RunConfig, model: Model, subject: str | None = None,
                         sides: tuple[str, ...] = ("reference", "subject")):
    """(reference, subject) engines of side_specs. Only ``sides`` are built (the other is None): a command
    that runs one side never fails on the other."""
    from ..engines.build import make_engine

    profile = config.profile
    specs = side_specs(config, subject)
    if config.cuda_options and not any(specs[side].engine == "cuda" for side in sides):
        raise UsageError(f"--cuda-options {config.cuda_options}: no side of this run is cuda"
                         f" ({', '.join(specs[s].engine for s in sides)}); drop it, or run --subject cuda")
    built = {"reference": None, "subject": None}
    for side in sides:
        spec = specs[side]
        if profile is not None and spec.engine in BUILTIN and spec.model and config.model \
                and os.path.realpath(spec.model) != os.path.realpath(config.model):
            from ..engines.profile import located

            raise located(profile, side, UsageError(
                f"{side} model {spec.model}: a built-in {spec.engine} decodes the model the reference loads"
                f" ({config.model}); give both sides the same model, or run this one as hf or llama.cpp"),
                option_hint=None) from None
        try:
            built[side] = make_engine(spec, model, kv=config.kv, deep=config.deep, impl=config.cpu_impl,
                                      cuda_options=config.cuda_options)
        except UsageError as e:
            if profile is None:
                raise
            from ..engines.profile import ProfileError, located

            raise (e if isinstance(e, ProfileError) else located(profile, side, e)) from None
    return built["reference"], built["subject"]


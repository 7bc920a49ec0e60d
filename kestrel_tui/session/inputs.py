"""What a run starts from, as the command-line options name it: the model and the prompt.

The CLI, the app's loader and the benchmarks share these; they live below the
CLI so that nothing imports from it.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace

from ..engines.registry import BUILTIN
from ..errors import UsageError
from ..model.progress import Progress
from ..model.weights import Model

DEFAULT_PROMPT_LEN = 16


def default_prompt(vocab: int, n: int = DEFAULT_PROMPT_LEN) -> list[int]:
    """The embedded model has no tokenizer: a fixed, spread-out id sequence."""
    return [(1 + 7919 * i) % vocab for i in range(n)]


def resolve_prompt(args: argparse.Namespace, model: Model, n_new: int | None = None,
                   flag: str = "--tokens") -> list[int]:
    """The prompt ids, checked with the ``n_new`` positions (default --tokens) that follow it.

    ``flag`` names the option that set ``n_new``, so an error blames what the user typed.
    """
    cfg = model.cfg
    if getattr(args, "prompt_ids", None):
        try:
            ids = [int(tok) for tok in args.prompt_ids.split(",") if tok.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers like 1,2,3") from None
        bad = [i for i in ids if not 0 <= i < cfg.vocab]
        if bad:
            raise UsageError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary 0..{cfg.vocab - 1}")
    elif getattr(args, "prompt", None) is not None:
        if model.tokenizer is None:
            why = f" ({model.notes[0]})" if model.notes else ""
            raise UsageError(f"--prompt needs a model with a tokenizer (tokenizer.json, or a GGUF's own){why};"
                             f" use --prompt-ids for this model")
        ids = model.tokenizer.encode(args.prompt).ids
    else:
        ids = default_prompt(cfg.vocab)
    if not ids:
        raise UsageError("the prompt is empty; give at least one token")
    n = getattr(args, "tokens", 0) if n_new is None else n_new
    if n < 1:
        raise UsageError(f"{flag} {n}: must be at least 1")
    room = cfg.max_positions - len(ids)
    if room < 1:
        prompt = _origin(args, "prompt_ids" if getattr(args, "prompt_ids", None) else "prompt", "the prompt")
        raise UsageError(f"{prompt}: {len(ids)} tokens fill the model's context of {cfg.max_positions} positions,"
                         f" and at least one must follow them; shorten it to {cfg.max_positions - 1} tokens or less")
    if n > room:
        where = _origin(args, "tokens", flag) if flag == "--tokens" else flag
        fix = f"use {flag} {room}" if where == flag else f"set tokens = {room}"
        raise UsageError(f"{where} {n}: the prompt ({len(ids)}) + {n} positions exceed the model's context of"
                         f" {cfg.max_positions}; {fix} or less, or a shorter prompt")
    return ids


def _origin(args: argparse.Namespace, name: str, flag: str) -> str:
    """Where a setting came from, as the user wrote it: the profile's FILE:LINE or the flag."""
    profile = getattr(args, "loaded_profile", None)
    if profile is None or name not in getattr(args, "from_profile", ()):
        return flag
    line = profile.line_of(name)
    return f"{profile.path}:{line}: {name}" if line is not None else f"{profile.path}: {name}"


def model_from_options(args: argparse.Namespace, progress: Progress | None = None) -> Model:
    """--model (None: the embedded default; an HF directory; a .gguf file) in --weights' format."""
    from ..model.hf import load_model

    return load_model(args.model, args.weights, progress=progress)


# What a flag left unset on the command line means (a profile may set it instead).
DEFAULTS = {"tokens": 16, "weights": "q4_0", "kv": "q8", "deep": False}


def apply_profile(args: argparse.Namespace):
    """Fill what the command line left unset from ``--profile`` (the command line wins), then the defaults.

    Returns the profile (None without one). Loading it checks everything that needs no model:
    a bad file, key or model path is one line here, before anything slow.
    """
    profile = None
    if getattr(args, "profile", None):
        from ..engines.profile import load_profile

        profile = load_profile(args.profile, model_override=getattr(args, "model", None))
        side_model = profile.reference.model or profile.subject.model or profile.model
        args.model = side_model
        taken = set()  # what the profile set, so an error about it names its line
        for name in ("tokens", "weights", "kv", "deep"):
            if getattr(args, name, None) is None and getattr(profile, name) is not None:
                setattr(args, name, getattr(profile, name))
                taken.add(name)
        if not getattr(args, "prompt_ids", None) and getattr(args, "prompt", None) is None:
            if profile.prompt_ids is not None:
                args.prompt_ids = ",".join(map(str, profile.prompt_ids))
                taken.add("prompt_ids")
            elif profile.prompt is not None:
                args.prompt = profile.prompt
                taken.add("prompt")
        args.from_profile = frozenset(taken)
        if getattr(args, "tol", None) is None and profile.tolerance is not None and hasattr(args, "tol"):
            args.tol = profile.tolerance
            args.tol_from_profile = True  # bisect uses it only when asked to target "no far key"
    for name, value in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    cuda_options(args, profile)  # a misspelt switch is one line here, before the model loads
    return profile


def cuda_options(args: argparse.Namespace, profile=None):
    """A cuda side's runtime switches: the environment's defaults, the profile's cuda subject
    options, then --cuda-options (backends/cuda/options.py)."""
    from ..backends.cuda.options import CudaOptions

    opts = CudaOptions.from_env()
    if profile is not None and profile.subject.engine == "cuda":
        opts = opts.set(dict(profile.subject.options))
    return opts.parse(getattr(args, "cuda_options", None))


def cache_from_options(args: argparse.Namespace):
    """The reference cache the command line asks for: the user's, unless --no-cache."""
    from .refcache import RefCache

    return None if getattr(args, "no_cache", False) else RefCache()


def engines_from_options(args: argparse.Namespace, profile, model: Model, subject: str | None = None,
                         sides: tuple[str, ...] = ("reference", "subject")):
    """(reference, subject) engines: the profile's, or cpu and ``subject`` (a built-in or hf name).
    Only ``sides`` are built (the other is None): a command that runs one side never fails on the other."""
    from ..engines.base import EngineSpec
    from ..engines.build import make_engine

    if profile is None:
        name = subject or getattr(args, "subject", None) or "sim"
        if name == "process":
            raise UsageError("--subject process: a process engine needs its command; name it in a profile"
                             " (--profile FILE, see docs/profiles.md)")
        specs = {"reference": EngineSpec("cpu"), "subject": EngineSpec(name, model=args.model)}
    else:
        specs = {"reference": profile.reference, "subject": profile.subject}
    cuda_flag = getattr(args, "cuda_options", None)
    if cuda_flag:  # --cuda-options: a cuda side's runtime switches, over the profile's
        cuda_options(args)  # a bad spelling is refused here, whatever the sides
        if not any(specs[side].engine == "cuda" for side in sides):
            raise UsageError(f"--cuda-options {cuda_flag}: no side of this run is cuda"
                             f" ({', '.join(specs[s].engine for s in sides)}); drop it, or run --subject cuda")
        flag = dict(s.strip().split("=", 1) for s in cuda_flag.split(",") if s.strip())
        specs = {side: replace(spec, options={**spec.options, **flag}) if spec.engine == "cuda" else spec
                 for side, spec in specs.items()}
    built = {"reference": None, "subject": None}
    for side, spec in specs.items():
        if side not in sides:
            continue
        if profile is not None and spec.engine in BUILTIN and spec.model and args.model \
                and os.path.realpath(spec.model) != os.path.realpath(args.model):
            from ..engines.profile import located

            raise located(profile, side, UsageError(
                f"{side} model {spec.model}: a built-in {spec.engine} decodes the model the reference loads"
                f" ({args.model}); give both sides the same model, or run this one as hf or llama.cpp"),
                option_hint=None) from None
        try:
            built[side] = make_engine(spec, model, kv=args.kv, deep=args.deep,
                                      impl=getattr(args, "reference", None) or "auto")  # --reference: a cpu side
        except UsageError as e:
            if profile is None:
                raise
            from ..engines.profile import ProfileError, located

            raise (e if isinstance(e, ProfileError) else located(profile, side, e)) from None
    return built["reference"], built["subject"]

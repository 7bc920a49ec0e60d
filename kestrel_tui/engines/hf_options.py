"""The hf engines' options, in one table each: what an option takes, its default and its toggle facts.

The hf engine's options are transformers' and torch's switches; hf-dist takes every one of them and
adds its own (the parallel plan, the ranks' threads and timeouts). Each value is checked here, once,
as a profile gives it — a TOML string, integer or float — and kept in one form: a choice's value as
its string ("2" for world_size = 2), a number as an int or a float. A value the option does not take
is one line naming the value given and what is allowed.

This module imports no torch until a value asks for CUDA.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import bounds
from ..errors import UsageError
from .base import MOST_THREADS, Toggle, check_toggle_keys
from .schedule import GRAMMAR, schedule_problem


@dataclass(frozen=True)
class Choice:
    """An option that takes one of ``values``, the default first. ``whole``: the values are whole numbers,
    so a TOML integer names one as its string does. ``only``: offered as a toggle only where torch sees
    CUDA ("cuda") or on a MoE model ("moe")."""
    name: str
    values: tuple[str, ...]
    help: str
    exact: str | None = None
    owns: tuple[str, ...] = ()
    whole: bool = False
    only: str | None = None

    @property
    def default(self) -> str:
        return self.values[0]

    def parse(self, value: object) -> str | None:
        if self.whole and WHOLE.problem(value) is None:
            value = str(WHOLE.parse(value, self.name))
        return value if isinstance(value, str) and value in self.values else None

    def refusal(self, value: object) -> str:
        return f" is not allowed; choose from {'|'.join(self.values)}"


@dataclass(frozen=True)
class Number:
    """An option that takes a number (``accepts``: whole or not, its range, its unit — bounds.Number's
    grammar, as every number the user gives); a setting of the run, never a toggle of the defaults."""
    name: str
    default: float
    accepts: bounds.Number
    help: str

    def parse(self, value: object) -> float | int | None:
        return None if self.accepts.problem(value) else self.accepts.parse(value, self.name)

    def refusal(self, value: object) -> str:
        return f": {self.accepts.problem(value)}; want {self.accepts.allowed()}"


@dataclass(frozen=True)
class ScheduleOption:
    """The option that takes a schedule (engines/schedule.py): a setting of the run, or a profile's toggle."""
    name: str = "schedule"
    default: str = "decode"
    help: str = "which positions share a forward pass: " + GRAMMAR

    def parse(self, value: object) -> str | None:
        return None if schedule_problem(value) else str(value)

    def refusal(self, value: object) -> str:
        return f": {schedule_problem(value)}; write {GRAMMAR}"


WHOLE = bounds.Number(whole=True)


def cuda_ok() -> bool:
    """Whether torch sees a CUDA device (torch is imported here: only a device choice asks)."""
    import torch

    return torch.cuda.is_available()


class OptionTable:
    """One engine's options by name: their checks, their defaults, a run's settings, the default toggles."""

    def __init__(self, engine: str, options: tuple[Choice | Number | ScheduleOption, ...]):
        self.engine = engine
        self.options = {o.name: o for o in options}

    def check(self, name: str, value: object, where: str = "option"):
        """``value`` as the option keeps it; one line for an option or a value it does not take."""
        opt = self.options.get(name)
        if opt is None:
            raise UsageError(f"{self.engine} engine: unknown {where} {name!r}; choose from {', '.join(self.options)}")
        got = opt.parse(value)
        if got is None:
            raise UsageError(f"{self.engine} engine: {name}={bounds.shown(value)}{opt.refusal(value)}")
        if name == "device" and got == "cuda" and not cuda_ok():
            raise UsageError(f"{self.engine} engine: device=cuda, but torch sees no CUDA device; use device=cpu")
        return got

    def parse(self, given: Mapping[str, object]) -> dict[str, object]:
        """Every option's value: the given ones checked, the rest their defaults."""
        out: dict[str, object] = {name: o.default for name, o in self.options.items()}
        for name, value in given.items():
            out[str(name)] = self.check(str(name), value)
        return out

    def check_toggles(self, toggles: tuple[Toggle, ...]) -> tuple[Toggle, ...]:
        """A profile's toggles: each sets one option, and every value is one that option takes."""
        check_toggle_keys(self.engine, toggles, lambda key, v: self.check(key, v, where="toggle key"))
        return toggles

    def settings(self, options: Mapping[str, object], toggles: tuple[Toggle, ...],
                 values: Mapping[str, str]) -> dict[str, object]:
        """Each option's value for a run: a toggle's value where one sets it, else the option's."""
        out = dict(options)
        for t in toggles:
            key = t.key or t.name
            out[key] = self.check(key, values.get(t.name, t.default), where="toggle key")
        return out

    def default_toggles(self, options: Mapping[str, object], moe: bool = False,
                        fits: Callable[[str, str], bool] = lambda name, value: True) -> tuple[Toggle, ...]:
        """One toggle per choice that can change anything here — its values those that ``fits`` the model
        and the machine, its first the option's value — CUDA's only where torch sees CUDA, MoE's only on a
        MoE model."""
        out = []
        for c in self.options.values():
            if not isinstance(c, Choice) or (c.only == "cuda" and not cuda_ok()) or (c.only == "moe" and not moe):
                continue
            values = tuple(v for v in c.values if fits(c.name, v))
            if len(values) < 2:
                continue
            first = options[c.name] if options[c.name] in values else values[0]
            out.append(Toggle(c.name, (first, *(v for v in values if v != first)), c.exact, c.owns, c.help,
                              key=c.name))
        return tuple(out)


# ---------------------------------------------------------------------------------------------- the tables

HF_CHOICES = (
    Choice("attn_implementation", ("eager", "sdpa"),
           "transformers' attention function: eager (matmul + softmax) or sdpa", exact="eager", owns=("attn",)),
    Choice("dtype", ("float32", "bfloat16", "float16"), "the torch dtype the checkpoint is loaded in"),
    Choice("prefill", ("batched", "token"), "the prompt as one forward (batched) or one token at a time",
           exact="token", owns=("k", "attn")),
    Choice("device", ("cpu", "cuda"), "where the model runs", only="cuda"),
    Choice("tf32", ("on", "off"), "TF32 matmuls and convolutions on CUDA", exact="off", owns=("kraw", "attn", "x")),
    Choice("deterministic", ("off", "on"), "torch.use_deterministic_algorithms", exact="on", owns=("attn", "x")),
    ScheduleOption(),
)
HF = OptionTable("hf", HF_CHOICES)

WORLD_SIZES = ("2", "1", "4")
HF_DIST = OptionTable("hf-dist", (
    Choice("world_size", WORLD_SIZES, "ranks: transformers' tensor-parallel plan over this many processes"
           " (1: no plan)", exact="1", owns=("ores", "x", "logits"), whole=True),
    Choice("split_sums", ("off", "2", "4"), "at world_size=1: also each row-parallel sum (o_proj, a dense"
           " FFN's down_proj) as the partial sums N ranks add, so a TP=N run's partials have a counterpart", whole=True),
    Choice("ep", ("off", "on"), "expert parallelism: each rank holds 1/N of the experts (the MoE's"
           " base_model_ep_plan)", exact="off", owns=("x",), only="moe"),
    Choice("ep_impl", ("all_reduce", "all_to_all"), "how EP brings experts their tokens: an all-reduce of"
           " partial outputs, or all-to-all", only="moe"),
    Choice("nccl_algo", ("default", "Ring", "Tree"), "NCCL_ALGO for the ranks' collectives (default: NCCL's"
           " choice)", only="cuda"),
    Choice("nccl_proto", ("default", "Simple", "LL", "LL128"), "NCCL_PROTO for the ranks' collectives (default:"
           " NCCL's choice)", only="cuda"),
    *HF_CHOICES,
    Number("threads", 1, bounds.Number(whole=True, lo=1, hi=MOST_THREADS),
           "torch CPU threads per rank (and OMP_NUM_THREADS)"),
    Number("timeout", 300.0, bounds.SECONDS, "the longest a step may take"),
    Number("load_timeout", 900.0, bounds.SECONDS, "the longest the ranks may take to load the model"),
))

"""Schedules: how one engine's run splits the same positions into forward passes (docs/schedules.md).

A run covers the prompt's P positions and N generated ones. Its schedule says which positions go into
one forward pass (a *group* of columns), in order:

    decode      the prompt in one pass, then one position a pass (a rollout's decode; the default)
    forward     every position in one causal pass (a trainer scoring a rollout)
    chunked:N   the prompt in passes of N positions (chunked prefill), then one a pass
    prefix:K    the first K positions in a pass of their own (an earlier request whose KV is reused),
                the rest of the prompt in one pass, then one a pass (a prefix-cache hit)
    verify:M    the prompt in one pass, then the generated positions M a pass (a speculative verifier
                checking M tokens at once)

forward and verify score tokens they are given (teacher forcing); an engine given none first decodes
them itself (its rollout), then scores them. The keys are the same per position whatever the schedule,
so any two schedules compare key by key.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import bounds
from ..errors import UsageError

KINDS = ("decode", "forward", "chunked", "prefix", "verify")
_SIZED = {"chunked": "N", "prefix": "K", "verify": "M"}
COLUMNS = bounds.Number(whole=True, lo=1, hi=1 << 20)  # a pass's columns: bounded before any plan is made
GRAMMAR = "decode, forward, chunked:N, prefix:K or verify:M (N, K, M whole numbers >= 1)"


@dataclass(frozen=True)
class Schedule:
    kind: str = "decode"
    n: int = 0  # chunked: N, prefix: K, verify: M

    def __str__(self) -> str:
        return f"{self.kind}:{self.n}" if self.kind in _SIZED else self.kind

    @property
    def scores_given_tokens(self) -> bool:
        """Whether a pass holds positions whose tokens must be known before it (forward, verify)."""
        return self.kind in ("forward", "verify")

    def groups(self, n_prompt: int, n_tokens: int, token_prefill: bool = False) -> list[tuple[int, int]]:
        """The passes as (first position, columns), in order, covering positions 0..P+N-1 once each.
        token_prefill: the decode schedule's prompt one position a pass (an engine's prefill option)."""
        P, total = n_prompt, n_prompt + n_tokens
        if self.kind == "forward":
            return [(0, total)]
        return self.prompt_groups(P, token_prefill) + self.generated_groups(P, n_tokens)

    def prompt_groups(self, n_prompt: int, token_prefill: bool = False) -> list[tuple[int, int]]:
        P = n_prompt
        if self.kind == "chunked" or (self.kind == "decode" and token_prefill):
            step = self.n if self.kind == "chunked" else 1
            return [(t, min(step, P - t)) for t in range(0, P, step)]
        if self.kind == "prefix":
            if self.n >= P:
                raise UsageError(f"schedule {self}: the prompt has {P} token(s); a reused prefix leaves at"
                                 f" least one to prefill: pick K from 1 to {P - 1}")
            return [(0, self.n), (self.n, P - self.n)]
        return [(0, P)]

    def generated_groups(self, n_prompt: int, n_tokens: int) -> list[tuple[int, int]]:
        P, total = n_prompt, n_prompt + n_tokens
        if n_tokens <= 0:
            return []
        if self.kind == "forward":
            return [(P, n_tokens)]
        step = self.n if self.kind == "verify" else 1
        return [(t, min(step, total - t)) for t in range(P, total, step)]


DECODE = Schedule()


def parse_schedule(value: object, where: str = "schedule") -> Schedule:
    """A schedule as the user writes it; a one-line UsageError naming the value and the grammar."""
    problem = schedule_problem(value)
    if problem:
        raise UsageError(f"{where} {value!r}: {problem}; write {GRAMMAR}")
    kind, _, n = str(value).partition(":")
    return Schedule(kind, int(COLUMNS.parse(n, where)) if kind in _SIZED else 0)


def schedule_problem(value: object) -> str | None:
    """What is wrong with a schedule's text, or None."""
    if not isinstance(value, str):
        return "is not text"
    kind, colon, n = value.partition(":")
    if kind not in KINDS:
        return "is no schedule"
    if kind in _SIZED:
        if not colon:
            return f"{kind} needs its {_SIZED[kind]} ({kind}:{_SIZED[kind]})"
        why = COLUMNS.problem(n)
        return f"{_SIZED[kind]} {why}" if why else None
    return f"{kind} takes no number" if colon else None

"""The cause test: is the first far key the source of everything after it, or one of several?

Graft the reference's values at the first far key's site (its field and layer, at every
position) into the subject's run and run again: if every key after it comes back ok (or close,
with a tolerance), that site was the only source; else the next first far key is another source,
grafted in its turn, until none is left or the limit is reached. The result lists every source in
dataflow order. A grafted key itself keeps the subject's own value (it is the source); the keys
after it are the test.

A q8 cache row and its scale are one site: grafting k takes ks too, v takes vs (the codes mean
nothing under another scale). Engines take a graft where Capabilities.graft says so: the sim (fed
steps), hf (forward hooks that return the reference's tensor), hf-dist (the same hooks on every rank,
each given its share of the reference's values).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..bounds import Number
from ..errors import UsageError
from ..text import inert
from ..trace.compare import Status, Tolerance
from ..trace.keys import parse_key
from .session import RunResult, RunSettings, Session

Site = tuple[str, "int | None"]
PAIRED = {"k": ("k", "ks"), "ks": ("k", "ks"), "v": ("v", "vs"), "vs": ("v", "vs")}
DEFAULT_LIMIT = 8
LIMIT = Number(whole=True, lo=1, unit="sources")  # more than the run has sites just grafts them all


@dataclass(frozen=True)
class Source:
    site: Site
    key: str                 # the first far (or DIFF) key it was found at
    next_key: str | None     # the first far key left once it (and every source before it) is grafted

    @property
    def label(self) -> str:
        field_name, layer = self.site
        return field_name if layer is None else f"{field_name} l{layer}"


@dataclass
class GraftResult:
    target: str                      # "far" (with a tolerance) or "ok" (bits)
    start: str | None                # the first far / DIFF key before any graft (None: nothing to graft)
    sources: list[Source] = field(default_factory=list)
    last: RunResult | None = None    # the run with every source grafted
    first: RunResult | None = None   # the run before any graft (where start was found)

    @property
    def remaining(self) -> str | None:
        """The first far key still left (the limit was reached); None: every source found."""
        return self.sources[-1].next_key if self.sources else self.start

    def line(self) -> str:
        if self.start is None:
            return f"nothing to graft: no {'far key' if self.target == 'far' else 'DIFF'}"
        names = ", ".join(s.label for s in self.sources)
        if self.remaining is None:
            return (f"the only source: {names}" if len(self.sources) == 1
                    else f"{len(self.sources)} sources, in order: {names}")
        return f"{len(self.sources)} sources so far ({names}); the limit left another at {self.remaining}"


def site_of(key: str) -> Site:
    k = parse_key(key)
    return k.field, k.layer


def sites_of(site: Site) -> frozenset[Site]:
    """The sites one graft takes: a q8 row with its scale."""
    field_name, layer = site
    return frozenset((f, layer) for f in PAIRED.get(field_name, (field_name,)))


def first_source(result: RunResult, tol: Tolerance | None, grafted: frozenset[Site]) -> str | None:
    """The first far key (with a tolerance) or DIFF key not at a grafted site, in dataflow order."""
    verdict = result.tolerance(tol).verdict if tol is not None else None
    for key, st in result.comparison.status.items():
        if st is not Status.DIFF or site_of(key) in grafted:
            continue
        if verdict is None or verdict.get(key) == "far":
            return key
    return None


def _check_start(key: str, first: RunResult, found: str | None) -> None:
    """A --key graft starts at: a key of the run whose bits differ (an ok key is no source of anything)."""
    status = first.comparison.status.get(key)
    if status is Status.DIFF:
        return
    shown = inert(key, 80)
    start = f"the first is {found}" if found is not None else "this run has none"
    if status is None:
        raise UsageError(f"--key {shown}: the run has no such key; name one of its DIFF keys ({start})")
    raise UsageError(f"--key {shown}: {status.value} in this run, not DIFF, so nothing comes from it; graft starts"
                     f" at a DIFF key ({start})")


def graft(session: Session, settings: RunSettings, tol: Tolerance | None = None, limit: int = DEFAULT_LIMIT,
          start: str | None = None, on_source: Callable[[Source], None] | None = None,
          cancel=None) -> GraftResult:
    """Graft sources one by one from ``start`` (default: the first far key, or the first DIFF without a
    tolerance) until no far key is left or ``limit`` sources are grafted."""
    if not session.subject_engine.caps.graft:
        raise UsageError(f"graft: the subject {session.subject} cannot take the reference's values at a key"
                         f" (engines that can: sim, hf, hf-dist)")
    LIMIT.parse(limit, "--limit")
    first = session.run(settings, record=False, cancel=cancel)
    found = first_source(first, tol, frozenset())
    out = GraftResult("far" if tol is not None else "ok", start if start is not None else found, last=first,
                      first=first)
    if start is not None:
        _check_start(start, first, found)
    grafted: frozenset[Site] = frozenset()
    key = out.start
    while key is not None and len(out.sources) < limit:
        grafted |= sites_of(site_of(key))
        out.last = session.run(settings, record=False, graft=grafted, cancel=cancel)
        nxt = first_source(out.last, tol, grafted)
        source = Source(site_of(key), key, nxt)
        out.sources.append(source)
        if on_source:
            on_source(source)
        key = nxt
    return out

"""Discrete events: where two runs part by a choice rather than by drift.

A far key after one of these is explained by it: an MoE layer that picked another expert set, a
greedy token that flipped at a near-tie, a q8_0 scale that rounded the other way. Each is found
from both sides' raw buffers alone, so any engine with raw values has them.

    experts    t<T>_l<L>_topk: the chosen expert sets differ (deep keys). The reference's router
               margin is the gap between its k-th and (k+1)-th router logit: small, a near-tie
    token      t<T>_logits: the top-1s differ. The reference's margin is its top-1 minus top-2
               logit; a near-tie when the logits' ordinary drift could close it (margin <= 2 x
               their RMS error), else beyond the drift: the top tokens moved more than the rest
               (the largest error is always at least half the margin of a flip, so it cannot
               tell the two apart)
    q8-scale   t<T>_l<L>_ks / _vs: a K or V row's q8 scale differs by one ULP, so every code of
               that row may round the other way (docs/numerics.md Q2)
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .compare import ulp_distance
from .keys import order_key, parse_key


SHORT = {"experts": "an expert flip", "token": "a top-1 flip", "q8-scale": "a q8 scale a ULP off"}


@dataclass(frozen=True)
class Event:
    key: str       # the key it shows at
    kind: str      # experts | token | q8-scale
    line: str      # one line for the status bar, the detail panel and --json
    margin: float | None = None   # the reference's margin (router or logits); None where it has none
    near_tie: bool = False

    @property
    def short(self) -> str:
        """A few words for the status line: "an expert flip at t16_l7_topk"."""
        return f"{SHORT[self.kind]} at {self.key}"

    def as_dict(self) -> dict:
        return {"key": self.key, "kind": self.kind, "line": self.line, "margin": self.margin,
                "near_tie": self.near_tie}


def logit_margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit (0.0 at an exact tie; inf with one logit)."""
    if logits.size < 2:
        return float("inf")
    top2 = np.partition(logits.astype(np.float64), -2)[-2:]
    return float(top2[1] - top2[0])


def expert_event(key: str, ref_ids: np.ndarray, sub_ids: np.ndarray, ref_router: np.ndarray | None) -> Event | None:
    ref_set, sub_set = set(ref_ids.tolist()), set(sub_ids.tolist())
    if ref_set == sub_set:
        return None
    margin = None
    if ref_router is not None and ref_router.size > len(ref_ids):
        ranked = np.sort(ref_router.astype(np.float64))[::-1]
        margin = float(ranked[len(ref_ids) - 1] - ranked[len(ref_ids)])
    k = parse_key(key)
    out, into = sorted(ref_set - sub_set), sorted(sub_set - ref_set)
    line = (f"t{k.t} l{k.layer}: the expert set flipped ({_ids(out)} -> {_ids(into)})"
            + (f", reference router margin {margin:.3g}" if margin is not None else ""))
    return Event(key, "experts", line, margin)


def token_event(key: str, ref_logits: np.ndarray, sub_logits: np.ndarray) -> Event | None:
    ref_top, sub_top = int(np.argmax(ref_logits)), int(np.argmax(sub_logits))
    if ref_top == sub_top:
        return None
    margin = logit_margin(ref_logits)
    rms = float(np.sqrt(np.mean((sub_logits.astype(np.float64) - ref_logits.astype(np.float64)) ** 2)))
    near = margin <= 2 * rms
    t = parse_key(key).t
    line = (f"t{t}: top-1 flipped {ref_top} -> {sub_top}, reference margin {margin:.3g}"
            f" {'<=' if near else '>'} 2 x the logits' RMS error {rms:.3g}"
            + (": a near-tie" if near else ": beyond the drift"))
    return Event(key, "token", line, margin, near)


def scale_event(key: str, ref: np.ndarray, sub: np.ndarray) -> Event | None:
    if ref.shape != sub.shape or ref.dtype != np.float32 or sub.dtype != np.float32:
        return None
    dist = ulp_distance(ref, sub)
    rows = np.flatnonzero(dist == 1)
    if rows.size == 0 or np.any(dist > 1):
        return None
    k = parse_key(key)
    what = "K" if k.field == "ks" else "V"
    line = (f"t{k.t} l{k.layer}: {rows.size} of {ref.size} {what}-row q8 scales rounded the other way"
            f" (1 ULP; heads {_ids(rows.tolist())})")
    return Event(key, "q8-scale", line)


def find_events(keys: Iterable[str], raw_ref, raw_sub) -> list[Event]:
    """The events among ``keys`` (DIFF keys), in dataflow order; ``raw_ref``/``raw_sub``: key -> array or None."""
    out = []
    for key in sorted(keys, key=order_key):
        field = parse_key(key).field
        if field not in ("topk", "logits", "ks", "vs"):
            continue
        a, b = raw_ref(key), raw_sub(key)
        if a is None or b is None:
            continue
        if field == "topk":
            router = raw_ref(key[: -len("topk")] + "router")
            event = expert_event(key, a, b, router)
        elif field == "logits":
            event = token_event(key, a, b)
        else:
            event = scale_event(key, a, b)
        if event is not None:
            out.append(event)
    return out


def event_before(events: list[Event], key: str) -> Event | None:
    """The last event at or before ``key`` in dataflow order that the keys after it inherit: an expert
    set or a q8 scale (both reach later positions through the residual and the KV cache). A flipped
    token is an outcome, not a cause: under teacher forcing the next position consumes the
    reference's token anyway."""
    at = order_key(key)
    best = None
    for e in events:
        if e.kind != "token" and order_key(e.key) <= at:
            best = e
    return best


def _ids(ids: list[int]) -> str:
    shown = ",".join(map(str, ids[:8])) + (",..." if len(ids) > 8 else "")
    return "{" + shown + "}"

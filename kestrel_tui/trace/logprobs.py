"""The logprob mismatch as RL users measure it: the same tokens scored by two engines or two schedules.

Per scored token the *log-ratio* is log p_subject(token) - log p_reference(token): the reference is
the behaviour policy (the rollout that chose the tokens), the subject the policy that re-scores them
(the trainer's forward). From the ratio r = exp(log-ratio), as truncated importance sampling and the
"off-policy RL" write-ups report it:

- the fraction of tokens with r outside each clip band ([0.8, 1.2], [0.9, 1.1]);
- the k1 and k3 estimators of KL(reference || subject) from the reference's samples:
  k1 = -log r, k3 = (r - 1) - log r (k3 is never negative; both average to the KL);
- max |Δp| = max |p_subject - p_reference| over the tokens;
- per sequence the geometric mean of r (exp of the mean log-ratio), which sequence-level importance
  sampling clips.

`MismatchTally` adds sequences one at a time and keeps only sums, a fixed histogram and the worst
token, so a file of 10^5 sequences is read in bounded memory; a run's figures are a tally of one.
All arithmetic is float64.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

CLIP_BANDS = ((0.8, 1.2), (0.9, 1.1))
# Histogram edges of the log-ratio: 0 is a bin of its own (the same probability to the bit), the clip
# bands' edges are edges, and the decades inside them show how close the rest is.
_SMALL = (1e-6, 1e-4, 1e-2, 0.05)
_BAND = {math.log(v) for band in CLIP_BANDS for v in band}
EDGES = tuple(sorted({-1.0, -0.5, *(-s for s in _SMALL), *_BAND, 0.0, *_SMALL, 0.5, 1.0}))
_ZERO = EDGES.index(0.0)
SEQ_KEEP = 1 << 20  # per-sequence ratios kept for --json; past this, only their range


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log p(token) from one position's logits, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = float(x.max())
    return float(x[token] - m - math.log(float(np.exp(x - m).sum())))


def bin_labels() -> list[str]:
    """One label per histogram bin, in order: below the first edge, the intervals up to 0, 0 itself, the
    intervals above it, at or above the last edge, and a bin for NaN."""
    below = [f"< {EDGES[0]:.3g}"] + [f"[{lo:.3g}, {hi:.3g})" for lo, hi in zip(EDGES[:_ZERO], EDGES[1:_ZERO + 1])]
    above = [f"(0, {EDGES[_ZERO + 1]:.3g})"] + [f"[{lo:.3g}, {hi:.3g})" for lo, hi in
                                                zip(EDGES[_ZERO + 1:], EDGES[_ZERO + 2:])]
    return below + ["= 0"] + above + [f">= {EDGES[-1]:.3g}", "NaN"]


def bin_of(log_ratio: np.ndarray) -> np.ndarray:
    """Each log-ratio's histogram bin: an index into bin_labels()."""
    x = np.asarray(log_ratio, dtype=np.float64)
    b = np.searchsorted(EDGES, x, side="right")  # a negative x: its interval; 0 and above: one past
    b = np.where(x > 0, b + 1, b)  # the positives move up one, past the bin of 0 alone
    b = np.where(x == 0, _ZERO + 1, b)
    return np.where(np.isnan(x), len(EDGES) + 2, b)


@dataclass
class MismatchTally:
    """Sums over every scored token of every sequence added."""
    tokens: int = 0
    sequences: int = 0
    outside: dict[tuple[float, float], int] = field(default_factory=lambda: {b: 0 for b in CLIP_BANDS})
    k1_sum: float = 0.0
    k3_sum: float = 0.0
    max_dp: float = 0.0
    bitwise: int = 0  # tokens whose two log-probabilities are the same float
    histogram: list[int] = field(default_factory=lambda: [0] * len(bin_labels()))
    seq_ratios: list[float] = field(default_factory=list)
    seq_ratio_min: float = math.inf
    seq_ratio_max: float = 0.0
    worst: tuple[float, int, int] | None = None  # (|log-ratio|, sequence, token index); a NaN one stays worst

    def add(self, reference: Sequence[float], subject: Sequence[float]) -> np.ndarray:
        """One sequence's chosen-token log-probabilities (the same tokens, in order); returns its log-ratios."""
        a = np.asarray(reference, dtype=np.float64)
        b = np.asarray(subject, dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1:
            raise ValueError(f"the two sides score {a.shape} and {b.shape} tokens; they must score the same ones")
        lr = b - a
        r = np.exp(lr)
        self.tokens += lr.size
        self.sequences += 1
        for lo, hi in CLIP_BANDS:
            self.outside[(lo, hi)] += int((~((r >= lo) & (r <= hi))).sum())  # NaN is outside
        self.k1_sum += float((-lr).sum())
        self.k3_sum += float((r - 1.0 - lr).sum())
        self.bitwise += int((a == b).sum())
        if lr.size:
            dp = float(np.abs(np.exp(b) - np.exp(a)).max())  # NaN when a side's log-probability is NaN
            if not dp <= self.max_dp:  # a NaN stays: a figure over NaN is not a number
                self.max_dp = dp
            for i, c in zip(*np.unique(bin_of(lr), return_counts=True)):
                self.histogram[int(i)] += int(c)
            j = int(np.argmax(np.abs(lr)))
            if self.worst is None or abs(lr[j]) > self.worst[0]:
                self.worst = (float(abs(lr[j])), self.sequences - 1, j)
            g = float(np.exp(lr.mean()))
            self.seq_ratio_min, self.seq_ratio_max = min(self.seq_ratio_min, g), max(self.seq_ratio_max, g)
            if len(self.seq_ratios) < SEQ_KEEP:
                self.seq_ratios.append(g)
        return lr

    def figures(self) -> dict:
        """The figures as --json gives them (fractions of tokens; None where there is no token)."""
        n = self.tokens
        frac = {f"outside_{lo:g}_{hi:g}": (self.outside[(lo, hi)] / n if n else None) for lo, hi in CLIP_BANDS}
        return {"sequences": self.sequences, "tokens": n, **frac,
                "k1": self.k1_sum / n if n else None, "k3": self.k3_sum / n if n else None,
                "max_abs_dp": self.max_dp if n else None, "bitwise_tokens": self.bitwise,
                "seq_geo_ratio_min": self.seq_ratio_min if n else None,  # sequences of no token have none
                "seq_geo_ratio_max": self.seq_ratio_max if n else None,
                "worst": None if self.worst is None else {"sequence": self.worst[1], "token": self.worst[2],
                                                          "abs_log_ratio": self.worst[0]},
                "histogram": dict(zip(bin_labels(), self.histogram))}

    def lines(self) -> list[str]:
        """The figures as plain text, one per line."""
        f = self.figures()
        if not self.tokens:
            return ["logprob mismatch: no scored token"]
        bands = ", ".join(f"{f[f'outside_{lo:g}_{hi:g}']:.2%} outside [{lo:g}, {hi:g}]" for lo, hi in CLIP_BANDS)
        return [f"logprob mismatch over {self.tokens} token(s) of {self.sequences} sequence(s):"
                f" {self.bitwise} bitwise-equal; {bands}",
                f"  KL(ref||subject) k1 {f['k1']:.3e}, k3 {f['k3']:.3e}; max |dp| {self.max_dp:.3e};"
                + (f" geometric-mean ratio {self.seq_ratio_min:.6f}" if self.sequences == 1 else
                   f" per-sequence geometric-mean ratio {self.seq_ratio_min:.6f}..{self.seq_ratio_max:.6f}")]


@dataclass(frozen=True)
class RunMismatch:
    """A run's logprob mismatch: the reference's chosen tokens scored by both sides."""
    tally: MismatchTally
    positions: tuple[int, ...]   # the position whose logits scored each token (P-1, P, ...)
    log_ratio: np.ndarray        # per scored token, subject over reference
    unscored: int                # generated tokens left out: the subject's context or logits differ there

    @property
    def worst_position(self) -> int | None:
        return None if self.tally.worst is None else self.positions[self.tally.worst[2]]

    def as_dict(self) -> dict:
        return {**self.tally.figures(), "positions": list(self.positions),
                "log_ratios": [float(x) for x in self.log_ratio], "unscored": self.unscored,
                "worst_position": self.worst_position}


def run_mismatch(reference, subject) -> RunMismatch | None:
    """The mismatch of two traces (trace.run.Trace) of the same prompt: at each position from the prompt's
    last, the log-probability of the token the reference chose next (the one it consumed after it, or at
    its last position its top-1) under each side's logits. A position counts while the subject consumed
    the same tokens up to it (teacher forcing: all of them); None when either side reports no logits."""
    P = len(reference.prompt)
    ref, sub = reference.positions, subject.positions
    if not ref or not sub or ref[0].logits is None or sub[0].logits is None:
        return None
    a, b, at = [], [], []
    wanted = len(ref) - P + 1
    for t in range(P - 1, len(ref)):
        if t >= len(sub) or sub[t].token != ref[t].token or sub[t].logits is None or ref[t].logits is None:
            break
        token = ref[t + 1].token if t + 1 < len(ref) else ref[t].top1
        if token < 0:
            break
        a.append(log_softmax_at(ref[t].logits, token))
        b.append(log_softmax_at(sub[t].logits, token))
        at.append(t)
    tally = MismatchTally()
    lr = tally.add(a, b)
    return RunMismatch(tally, tuple(at), lr, wanted - len(at))

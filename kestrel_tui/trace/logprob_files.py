"""Two JSONL files of chosen-token log-probabilities, read line by line and paired into a MismatchTally.

Each line is one sequence, ``{"token_ids": [...], "logprobs": [...]}`` (other keys are ignored); line i
of A (the reference: the rollout that chose the tokens) pairs with line i of B (the subject that re-scores
them). A pair compares its shared tokens: the same token_ids, or one side's token_ids a suffix of the
other's (a trainer logs prompt + response, a serving engine the response only). A `null` logprob (a
serving engine has none for the first prompt token) leaves that token unscored on both sides.

What a logprob may be: a finite number <= 0; `-Infinity` (Python's json writes it for float('-inf')) in
B only, where it says the subject gives the token probability 0; never in A, whose policy chose the
token. Anything else is one UsageError naming the file, the line and the problem.

Bounded memory: one line of each file at a time (a line is at most LINE_LIMIT bytes), plus the tally's
sums and the worst sequence's token ids.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from ..readers import NotRegular, open_regular
from ..text import inert
from .logprobs import MismatchTally

LINE_LIMIT = 64 << 20  # bytes of one line: 10^6 tokens of prompt + response with room to spare
TOKEN_LIMIT = 1 << 31  # token ids are int32, as every vocabulary's are
_SHAPE = '{"token_ids": [...], "logprobs": [...]}'


class _Constant(float):
    """A float JSON spelled as a word (NaN, Infinity, -Infinity), kept apart from a literal that overflowed."""


def _constant(word: str) -> _Constant:
    return _Constant(word)


@dataclass(frozen=True)
class Sequence:
    """One line: its token ids and their log-probabilities (NaN where the file has null)."""
    token_ids: list[int]
    logprobs: np.ndarray


@dataclass(frozen=True)
class WorstToken:
    """Where the largest |log-ratio| is: the line, its index in each side's arrays, the token."""
    line: int
    index_a: int
    index_b: int
    token_id: int
    logprob_a: float
    logprob_b: float
    token_ids: list[int]  # the sequence's ids from the side that has more of them (the prompt too)
    index: int  # the token's index in token_ids

    def as_dict(self) -> dict:
        return {"line": self.line, "index_a": self.index_a, "index_b": self.index_b, "token_id": self.token_id,
                "logprob_a": self.logprob_a, "logprob_b": self.logprob_b}


@dataclass
class Comparison:
    tally: MismatchTally
    worst: WorstToken | None


def _what(v) -> str:
    """A JSON value's kind, as a message names it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return {str: "a string", list: "an array", dict: "an object", int: "an integer",
            float: "a number", _Constant: "a number"}.get(type(v), type(v).__name__)


def _lines(path: str, shown: str, progress: Callable[[int], None] | None) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line, never more than LINE_LIMIT bytes of one in memory."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        raise UsageError(f"{shown}: no such file; name a JSONL file of {_SHAPE} lines") from None
    except IsADirectoryError:
        raise UsageError(f"{shown}: is a directory; name a JSONL file of {_SHAPE} lines") from None
    except NotRegular as e:
        raise UsageError(f"{shown}: {e.strerror}; name a JSONL file of {_SHAPE} lines") from None
    except OSError as e:
        raise UsageError(f"{shown}: cannot open it ({inert(e.strerror)}); name a readable JSONL file") from None
    with f:
        n = 0
        while True:
            try:
                data = f.readline(LINE_LIMIT + 1)
            except OSError as e:
                raise UsageError(f"{shown}:{n + 1}: cannot read it ({inert(e.strerror)})") from None
            if not data:
                return
            n += 1
            if len(data) > LINE_LIMIT:
                raise UsageError(f"{shown}:{n}: a line longer than {LINE_LIMIT >> 20} MiB; one sequence a line,"
                                 f" each at most {LINE_LIMIT >> 20} MiB")
            if progress is not None:
                progress(len(data))
            yield n, data


def parse_line(data: bytes, at: str, side: str) -> Sequence:
    """One line's sequence, or UsageError "AT: problem; fix" (AT names the file and line)."""
    def refuse(problem: str, fix: str = f"each line is one JSON object {_SHAPE}") -> UsageError:
        return UsageError(f"{at}: {problem}; {fix}")

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise refuse(f"not UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1})") from None
    if not text or text.isspace():
        raise refuse("a blank line", "one sequence a line, no blank lines (line i of A pairs with line i of B)")
    try:
        doc = json.loads(text, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise refuse(f"not JSON ({inert(e.msg)} at column {e.colno})") from None
    except RecursionError:
        raise refuse("not JSON (arrays or objects nested thousands deep)") from None
    except ValueError:  # int() of more digits than Python converts
        raise refuse("a number of thousands of digits") from None
    if not isinstance(doc, dict):
        raise refuse(f"{_what(doc)}, not an object")
    for key in ("token_ids", "logprobs"):
        if key not in doc:
            keys = ", ".join(inert(k, 40) for k in list(doc)[:8]) or "none"
            raise refuse(f'no "{key}" key (its keys: {keys})')
        if not isinstance(doc[key], list):
            raise refuse(f'"{key}" is {_what(doc[key])}, not an array')
    ids, lps = doc["token_ids"], doc["logprobs"]
    if len(ids) != len(lps):
        raise refuse(f"{len(ids)} token_ids but {len(lps)} logprobs", "give one logprob per token (null for none)")
    if not {type(v) for v in ids} <= {int}:
        i = next(i for i, v in enumerate(ids) if type(v) is not int)
        raise refuse(f"token_ids[{i}] is {_what(ids[i])}, not an integer")
    if ids and (min(ids) < 0 or max(ids) >= TOKEN_LIMIT):
        i = next(i for i, v in enumerate(ids) if not 0 <= v < TOKEN_LIMIT)
        raise refuse(f"token_ids[{i}] is {inert(ids[i], 40)}, not a token id", f"token ids are 0..{TOKEN_LIMIT - 1}")
    return Sequence(ids, _logprobs(lps, side, refuse))


def _logprobs(lps: list, side: str, refuse) -> np.ndarray:
    """The logprobs as float64, NaN for null; refused: non-numbers, NaN, positive, overflowed, -Infinity in A."""
    kinds = {type(v) for v in lps}
    if not kinds <= {float, int, type(None), _Constant}:
        i = next(i for i, v in enumerate(lps) if type(v) not in (float, int, type(None), _Constant))
        raise refuse(f"logprobs[{i}] is {_what(lps[i])}, not a number or null")
    try:
        x = np.array([math.nan if v is None else v for v in lps] if type(None) in kinds else lps, dtype=np.float64)
    except OverflowError:  # an integer beyond float64
        i = next(i for i, v in enumerate(lps) if type(v) is int and abs(v) > 1e308)
        raise refuse(f"logprobs[{i}] is beyond float64's range", "a log-probability is a number <= 0") from None
    bad = ~np.isfinite(x) | (x > 0)
    if type(None) in kinds:
        bad &= np.array([v is not None for v in lps])
    for i in map(int, np.flatnonzero(bad)):
        v = lps[i]
        if isinstance(v, _Constant):
            if math.isinf(v) and v < 0 and side == "B":
                continue
            if math.isinf(v) and v < 0:
                raise refuse(f"logprobs[{i}] is -Infinity: the reference chose this token, so it cannot have had"
                             f" probability 0", "A is the policy that sampled the tokens; -Infinity belongs in B"
                             " only")
            raise refuse(f"logprobs[{i}] is {'NaN' if math.isnan(v) else 'Infinity'}",
                         "a log-probability is a number <= 0 (or null for none)")
        if math.isinf(v):
            raise refuse(f"logprobs[{i}] is {inert(v, 40)}, beyond float64's range",
                         "a log-probability is a number <= 0")
        raise refuse(f"logprobs[{i}] is {v!r}, above 0: no probability is above 1",
                     "give each token's log-probability (<= 0)")
    return x


def align(a: list[int], b: list[int]) -> tuple[int, int, int] | None:
    """(start in A, start in B, length) of the shared tokens: the same ids, or one side's ids a suffix of
    the other's; None when neither holds."""
    n = min(len(a), len(b))
    if a[len(a) - n:] == b[len(b) - n:]:
        return len(a) - n, len(b) - n, n
    return None


def _mismatch(a: list[int], b: list[int]) -> str:
    """What differs between two id lists that do not align, counted from their ends."""
    n = min(len(a), len(b))
    ra = np.asarray(a[len(a) - n:], dtype=np.int64)[::-1]
    rb = np.asarray(b[len(b) - n:], dtype=np.int64)[::-1]
    k = int(np.flatnonzero(ra != rb)[0])
    return (f"A has {len(a)} token ids, B {len(b)}, and neither is a suffix of the other: from the end they"
            f" first differ at A[{len(a) - 1 - k}] = {a[len(a) - 1 - k]}, B[{len(b) - 1 - k}] = {b[len(b) - 1 - k]}")


def compare_files(path_a: str, path_b: str, progress: Callable[[int], None] | None = None) -> Comparison:
    """Every line pair of the two files tallied; UsageError names the file and line of the first bad one.
    `progress` is told the bytes of each line read (of either file)."""
    shown_a, shown_b = inert(path_a), inert(path_b)
    tally = MismatchTally()
    worst: WorstToken | None = None
    lines_a, lines_b = _lines(path_a, shown_a, progress), _lines(path_b, shown_b, progress)
    for (n, da), lb in _pairs(lines_a, lines_b, shown_a, shown_b):
        a = parse_line(da, f"{shown_a}:{n}", "A")
        b = parse_line(lb, f"{shown_b}:{n}", "B")
        span = align(a.token_ids, b.token_ids)
        if span is None:
            raise UsageError(f"{shown_a}:{n} and {shown_b}:{n} score different tokens:"
                             f" {_mismatch(a.token_ids, b.token_ids)}; line i of A and line i of B must hold the"
                             f" same sequence")
        sa, sb, length = span
        la, lb_ = a.logprobs[sa:sa + length], b.logprobs[sb:sb + length]
        kept = np.flatnonzero(~(np.isnan(la) | np.isnan(lb_)))
        tally.add(la[kept], lb_[kept])
        if tally.worst is not None and tally.worst[1] == tally.sequences - 1:
            j = int(kept[tally.worst[2]])
            longer, at = (a.token_ids, sa + j) if len(a.token_ids) >= len(b.token_ids) else (b.token_ids, sb + j)
            worst = WorstToken(n, sa + j, sb + j, a.token_ids[sa + j], float(la[j]), float(lb_[j]), longer, at)
    if tally.sequences == 0:
        raise UsageError(f"{shown_a} and {shown_b} are empty: no sequence to compare; give one {_SHAPE} a line")
    if tally.tokens == 0:
        raise UsageError(f"{shown_a} and {shown_b}: no token has a log-probability on both sides (every shared"
                         f" token is null on one side); give the chosen tokens' log-probabilities")
    return Comparison(tally, worst)


def _pairs(lines_a, lines_b, shown_a: str, shown_b: str):
    """Line i of A with line i of B; a file that ends first is an error naming both counts."""
    n = 0
    while True:
        la, lb = next(lines_a, None), next(lines_b, None)
        if la is None and lb is None:
            return
        if la is None or lb is None:
            short, long_ = (shown_a, shown_b) if la is None else (shown_b, shown_a)
            has = "is empty" if n == 0 else f"has {n} line(s)"
            raise UsageError(f"{short} {has} and {long_} more: line i of A pairs with line i of B;"
                             f" give both files the same sequences")
        n += 1
        yield la, lb[1]


def total_bytes(*paths: str) -> int | None:
    """The files' sizes added (for a progress bar), None when one cannot be read."""
    try:
        return sum(os.stat(p).st_size for p in paths)
    except OSError:
        return None

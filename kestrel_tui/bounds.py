"""Numbers the user gives (an option's text, a profile's TOML value), checked in one place.

A setting that takes a number declares it once as a `Number`: whole or not, its range, its unit.
`Number.parse` turns what was given into the value or refuses it in one line that says what was
given and what is allowed. Python's own `int()` and `float()` take more than a user means: `nan`,
`inf` and `1e400` (infinite once read) would switch a bound off, since every comparison with NaN is
false and nothing is above infinity; `١` (an Arabic-Indic digit) reads as 1 and `1_0` as 10. Here a
number is written in ASCII: an optional sign, the digits 0-9, and for a number that need not be
whole a decimal point and an exponent; it is finite, and within its range.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import UsageError

_WHOLE = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SHOWN = 60  # characters of a refused value a message quotes
MAX_SECONDS = 7 * 24 * 3600  # a timeout longer than a week is no timeout: leave the setting out instead


@dataclass(frozen=True)
class Number:
    """The numbers a setting takes; ``lo``/``hi`` None: no bound on that side."""
    whole: bool = False
    lo: float | None = None
    hi: float | None = None
    above: bool = False         # lo itself is refused (a size must be above 0)
    unit: str = ""              # how the values read: "MB", "seconds", "ULPs"

    def range(self) -> str:
        """">= 0", "from 1 to 8", "above 0 and at most 65536", "" (any)."""
        lo = None if self.lo is None else _fmt(self.lo)
        hi = None if self.hi is None else _fmt(self.hi)
        if lo is not None and hi is not None:
            return f"above {lo} and at most {hi}" if self.above else f"from {lo} to {hi}"
        if lo is not None:
            return f"above {lo}" if self.above else f">= {lo}"
        return f"<= {hi}" if hi is not None else ""

    def allowed(self) -> str:
        """What is allowed, in words: "a whole number of ULPs >= 0"."""
        kind = ("a whole number" if self.whole else "a number") + (f" of {self.unit}" if self.unit else "")
        return f"{kind} {self.range()}".rstrip()

    def problem(self, value: object) -> str | None:
        """What is wrong with ``value`` ("is below 1", "is not finite"), or None when it is allowed."""
        x = self._read(value)
        if isinstance(x, str):
            return x
        if isinstance(x, float) and not math.isfinite(x):
            return "is not finite"
        if self.lo is not None and x < self.lo:
            return f"is below {_fmt(self.lo)}"
        if self.above and x == self.lo:
            return f"is not above {_fmt(self.lo)}"
        if self.hi is not None and x > self.hi:
            return f"is above {_fmt(self.hi)}"
        return None

    def parse(self, value: object, name: str) -> int | float:
        """The number ``value`` stands for; else UsageError ``NAME 'VALUE': problem; want what is allowed``."""
        problem = self.problem(value)
        if problem is not None:
            raise UsageError(f"{name} {shown(value)}: {problem}; want {self.allowed()}")
        x = self._read(value)
        return int(x) if self.whole else float(x)

    def _read(self, value: object) -> int | float | str:
        """The value as a number (unchecked), or the phrase that says why it is none."""
        if isinstance(value, bool):  # TOML's true is no number, though Python's bool is an int
            return "is not a number"
        if isinstance(value, int):
            if self.whole or abs(value) < 2**1023:
                return value
            return math.inf if value > 0 else -math.inf  # float() of it would raise
        if isinstance(value, float):
            if self.whole and not (math.isfinite(value) and value.is_integer()):
                return "is not a whole number" if math.isfinite(value) else value
            return int(value) if self.whole else value
        if not isinstance(value, str):
            return "is not a number"
        text = value.strip()
        if not (_WHOLE if self.whole else _REAL).fullmatch(text):
            if _python_float(text) in (math.inf, -math.inf) or _python_float(text) != _python_float(text):
                return "is not finite"  # nan, inf, infinity: words float() takes
            return ("is not a whole number" if self.whole else "is not a number") + _why_not(text)
        if not self.whole:
            return float(text)  # 1e400 is inf here, and refused as such
        try:
            return int(text)
        except ValueError:  # more digits than int() takes: beyond any range a setting has
            return "has more digits than any number here"


def _python_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _why_not(text: str) -> str:
    """What in ``text`` Python would take that this grammar does not, said so that it can be fixed."""
    if not text.isascii():
        return ", written with the digits 0-9"
    if "_" in text:
        return ", written without '_'"
    return ""


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def shown(value: object) -> str:
    """A given value as a message quotes it: repr (control characters escaped), clipped."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"(a whole number of {value.bit_length()} bits)"  # repr() of a huge int is refused or slow
    s = repr(value)
    return s if len(s) <= _SHOWN else s[:_SHOWN - 4] + "...'"


# A timeout, wherever one is set (a process engine's `timeout`, an engine's step timeout).
SECONDS = Number(lo=0, above=True, hi=MAX_SECONDS, unit="seconds")

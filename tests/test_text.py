"""Outside text is inert: control characters escaped, long strings clipped (kestrel_tui/text.py)."""
from __future__ import annotations

import unicodedata

from hypothesis import given, strategies as st

from kestrel_tui.text import LIMIT, inert, inert_tail


def test_terminal_controls_are_escaped():
    # an OSC that sets the window title, a clear screen, a one-byte CSI, a bidi override, a line break
    raw = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202eabc\u2028x\ny"
    out = inert(raw)
    assert out == "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\u202eabc\\u2028x\\ny"


def test_long_text_is_clipped_and_says_so():
    out = inert("a" * 52_000_000)
    assert len(out) < LIMIT + 40 and out.endswith(f"({52_000_000 - LIMIT} more characters)")
    tail = inert_tail("x" * 1000 + "the last words")
    assert tail.endswith("the last words") and tail.startswith("(… 714 characters)")


@given(st.text(max_size=2000))
def test_no_control_character_survives(s):
    out = inert(s)
    assert all(c.isprintable() or unicodedata.category(c) == "Zs" for c in out)
    assert len(out) <= LIMIT * 10 + 40  # an escape is at most 10 characters

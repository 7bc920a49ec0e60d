"""Outside text made inert before it is shown: an engine's stderr, a profile's names, a dump's tags.

Such text reaches a terminal (the console, the app's widgets). A control character in it could set
the window title, clear the screen or move the cursor, and a line of megabytes would be one "line"
of a message. ``inert`` writes every control character as an escape (``\\x1b``, ``\\n``) and clips
the text to a few hundred characters, saying how much was left off. Markup is a separate matter:
the consoles and widgets print outside text as plain text, never as markup.
"""
from __future__ import annotations

import unicodedata

LIMIT = 300  # characters an outside string keeps in a message

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def _is_control(ch: str) -> bool:
    # Cc: C0, DEL and C1 (0x9b is a one-byte CSI); Cf: bidi overrides and other invisible formatting;
    # Zl/Zp: line and paragraph separators (a line break to some terminals); Cs/Co/Cn: lone
    # surrogates, private use and unassigned code points, which terminals draw as they like
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")


def inert(text: object, limit: int = LIMIT) -> str:
    """`text` with control characters escaped, clipped to about `limit` characters."""
    s = text if isinstance(text, str) else str(text)
    more = len(s) - limit
    if more > 0:
        s = s[:limit]
    out = "".join(_escape(c) if _is_control(c) else c for c in s)
    if more > 0:
        out += f"… ({more} more characters)"
    return out


def inert_tail(text: str, limit: int = LIMIT) -> str:
    """The last `limit` characters of `text` (a stderr tail), escaped like ``inert``."""
    s = text.rstrip()
    if len(s) <= limit:
        return inert(s, limit)
    return f"(… {len(s) - limit} characters) " + inert(s[-limit:], limit)

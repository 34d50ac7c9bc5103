"""Characters an id may not hold because of how it reads, shared by the server and the CLI.

The server refuses ids holding them (``leasekeeper_server.rpc.validate``); the
``leasekeeper`` command's tables escape them in ids stored before that rule.
"""

from __future__ import annotations

import unicodedata

BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
"""Unicode's Bidi_Control characters: ALM, LRM and RLM (U+061C, U+200E, U+200F),
the embeddings and overrides (U+202A-U+202E) and the isolates (U+2066-U+2069).
Invisible, and able to reorder what a table or a log line shows around them, so
that one id displays as another (Trojan Source, CVE-2021-42574)."""

LINE_SEPARATORS = frozenset("\u2028\u2029")
"""U+2028 LINE SEPARATOR and U+2029 PARAGRAPH SEPARATOR (categories Zl, Zp): not
control characters, but they break the line of a log or a table as a newline does."""

BLANK_FILLERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
"""Letters and symbols that draw nothing: the Hangul fillers (U+115F, U+1160,
U+3164, U+FFA0) and the blank braille pattern (U+2800)."""


def is_invisible(ch: str) -> bool:
    """True for a character that shows nothing by itself.

    Whitespace, format characters (category Cf: zero-width space and joiners,
    BOM, word joiner, invisible operators, soft hyphen, the bidirectional
    controls) and :data:`BLANK_FILLERS`. Inside an id with visible characters
    they are allowed (emoji sequences and Indic or Persian text need ZWJ/ZWNJ).
    """
    return ch.isspace() or unicodedata.category(ch) == "Cf" or ch in BLANK_FILLERS


def has_visible(text: str) -> bool:
    """True when ``text`` holds a character that is not :func:`is_invisible`."""
    return not all(map(is_invisible, text))


def refusal(text: str) -> str | None:
    """Why ``text`` may not be an id, or None: the character rule of every id.

    Refused: a control character (Cc, NUL included) or surrogate (Cs); a
    bidirectional control; a line or paragraph separator; and text without a
    visible character (:func:`has_visible`), which reads as empty.
    """
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cs"):
            return f"contains control character U+{ord(ch):04X}"
        if ch in BIDI_CONTROLS:
            return (
                f"contains bidirectional control character U+{ord(ch):04X}, "
                "which can make it display as another id"
            )
        if ch in LINE_SEPARATORS:
            return f"contains line separator U+{ord(ch):04X}, which breaks the line it is shown on"
    if text and not has_visible(text):
        if text.isspace():
            return "must not be only whitespace"
        return "must hold a visible character, not only whitespace and invisible characters"
    return None

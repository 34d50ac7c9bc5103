"""Characters an id may not hold because of how it reads, shared by the server and the CLI.

The server refuses ids holding them (``leasekeeper_server.validate``); the
``leasekeeper`` command's tables escape them in ids stored before that rule.
"""

from __future__ import annotations

BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
"""Unicode's Bidi_Control characters: ALM, LRM and RLM (U+061C, U+200E, U+200F),
the embeddings and overrides (U+202A-U+202E) and the isolates (U+2066-U+2069).
Invisible, and able to reorder what a table or a log line shows around them, so
that one id displays as another (Trojan Source, CVE-2021-42574)."""

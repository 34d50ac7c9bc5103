"""Page tokens of the listings: keyset positions, signed and bound to their listing.

A token says where the next page starts (the task_id, effect_key, history
sequence or namespace of the last row read) and can only be used to go on
with the listing that issued it:

    token = base64url(VERSION || mac || position)
    mac   = HMAC-SHA256(key, JSON [*listing, position])[:16]

``listing`` is what the caller chose besides the page size: the RPC, the
namespace and every filter (ListLeases: state, owner_id; ListEffects:
task_id, state; ListNamespaces: none). The position is not secret (it is a row the caller was
shown); what the MAC adds is that a token changed by a byte, made up (the
old format was base64 of the task_id), or sent with another namespace or
filters is refused with INVALID_ARGUMENT naming ``page_token``, instead of
silently skipping rows or returning an empty last page. The page size is not
bound: a caller may change it between pages.

The key is the database's (migrations/0007_page_token_key.sql), read once at
start, so every replica accepts every other's tokens, across restarts,
without configuration. 16 bytes of the MAC (128 bits) are kept: a forger
gets one guess per call.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Callable, Sequence
from typing import TypeVar

from leasekeeper_server.core.errors import InvalidArgument

# The listings' page sizes: the default for page_size 0, and the largest.
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000

Row = TypeVar("Row")
# What a token is bound to: the RPC's name, then the namespace and the filters
# (None for an unset filter).
Listing = Sequence[str | None]

_VERSION = b"\x01"
_MAC_BYTES = 16
_REFUSED = (
    "is not a page token of this listing: tokens are signed by the server and bound to the"
    " namespace and filters of the call that issued them (list again from the first page)"
)


class PageTokens:
    """Issues and checks the page tokens of one key (pure; no I/O).

    Args:
        key: the HMAC key, the same on every replica (at least 32 bytes).
    """

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("a page token key has at least 32 bytes")
        self._key = key

    def _mac(self, listing: Listing, position: str) -> bytes:
        message = json.dumps([*listing, position], ensure_ascii=False).encode("utf-8")
        return hmac.new(self._key, message, hashlib.sha256).digest()[:_MAC_BYTES]

    def issue(self, listing: Listing, position: str) -> str:
        """The token of the page that starts after ``position`` in ``listing``."""
        body = _VERSION + self._mac(listing, position) + position.encode("utf-8")
        return base64.urlsafe_b64encode(body).decode("ascii")

    def position(self, listing: Listing, token: str) -> str:
        """Where the page of ``token`` starts (after this key; '' for an empty token).

        Raises:
            InvalidArgument: (INVALID_ARGUMENT, field ``page_token``) the token
                was not issued by this service for ``listing``.
        """
        if not token:
            return ""
        try:
            body = base64.b64decode(token.encode("ascii"), altchars=b"-_", validate=True)
            mac, position = body[1 : 1 + _MAC_BYTES], body[1 + _MAC_BYTES :].decode("utf-8")
        except (UnicodeError, binascii.Error):
            raise InvalidArgument("page_token", _REFUSED) from None
        if body[:1] != _VERSION or not hmac.compare_digest(mac, self._mac(listing, position)):
            raise InvalidArgument("page_token", _REFUSED)
        return position

    def page(
        self, listing: Listing, rows: list[Row], size: int, position: Callable[[Row], str]
    ) -> tuple[list[Row], str]:
        """One page of rows fetched as ``size + 1``, and the next page's token ('' if last)."""
        if len(rows) <= size:
            return rows, ""
        return rows[:size], self.issue(listing, position(rows[size - 1]))

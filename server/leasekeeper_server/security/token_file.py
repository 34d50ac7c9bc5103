"""The token file as a token source: loaded at start, reloaded when it changes.

The file (``LEASEKEEPER_TOKENS_FILE``, format in :mod:`leasekeeper_server.security.tokens`)
is checked at most once a second (``FILE_CHECK_INTERVAL_S``) and reloaded when
its size, mtime or inode changed. A file that is malformed at a reload keeps
the tokens loaded before and logs an error; at start it fails the start.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from leasekeeper_server.security import tokens
from leasekeeper_server.security.access_log import log

FILE_CHECK_INTERVAL_S = 1.0


class TokenFile:
    """A token file, reloaded when its size, mtime or inode changes.

    Args:
        path: The file (see :mod:`leasekeeper_server.security.tokens`).

    Raises:
        ValueError: the file cannot be read or is malformed (at start only;
            a bad file at a reload keeps the previous tokens and logs an error).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp = self._stat()
        self._grants = tokens.load_token_file(path)
        self._checked = time.monotonic()
        log.info("token file %s: %d token(s)", path, len(self._grants))

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def grants(self) -> dict[bytes, tokens.TokenGrant]:
        """The current tokens by digest, reloading first if the file changed."""
        now = time.monotonic()
        if now - self._checked >= FILE_CHECK_INTERVAL_S:
            self._checked = now
            stamp = self._stat()
            if stamp != self._stamp:
                self._reload(stamp)
        return self._grants

    def _reload(self, stamp: tuple[int, int, int] | None) -> None:
        self._stamp = stamp
        try:
            self._grants = tokens.load_token_file(self.path)
        except ValueError as exc:
            log.error("%s; keeping the %d token(s) loaded before", exc, len(self._grants))
            return
        log.info("token file %s reloaded: %d token(s)", self.path, len(self._grants))

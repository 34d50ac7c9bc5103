"""Owner ids (one per worker incarnation) and request ids (one per logical claim).

The contract says two processes must never share an ``owner_id``. A server
that sees the owner of a live lease claim the task again must tell a retry of
the claim whose reply was lost (hand the *same* lease back) from a new
incarnation of the owner, such as a restarted process that reuses an explicit
owner id (grant a new fence, so that the old incarnation's fence stops being
valid). The request id tells them apart: one per logical claim, sent again
unchanged with every retry of it (AIP-155). A claim without one gets the same
lease back, as before request ids existed.

A child made by ``fork()`` that kept its parent's owner id would share the
parent's leases. Every default owner id is tracked here and replaced in the
child right after a fork.
"""

from __future__ import annotations

import os
import secrets
import socket
import uuid
import weakref

_ID_RANDOM_BYTES = 8


def new_owner_id() -> str:
    """Make a fresh owner id, ``"{hostname}-{pid}-{random hex}"``.

    Every call returns a new id (64 random bits), so ids are unique per call and
    therefore per process incarnation. The hostname and pid are there for
    operators reading ``ListLeases``; uniqueness comes from the random part.

    Returns:
        The owner id (ASCII, at most about 100 bytes, well inside the server's
        default limit of 256 bytes).

    """
    host = socket.gethostname().split(".", 1)[0] or "host"
    return f"{host[:64]}-{os.getpid()}-{secrets.token_hex(_ID_RANDOM_BYTES)}"


def new_request_id() -> str:
    """Make a fresh request id for one logical claim: a UUID4 string (36 ASCII characters).

    Send it with the claim and again, unchanged, with every retry of that claim:
    a retry then gets the same lease back, while a claim with a new request id
    by the owner of a live lease is a new incarnation and gets a new fence.

    Returns:
        The request id, e.g. ``"1b4e28ba-2fa1-41d2-883f-0016d3cca427"``.

    """
    return str(uuid.uuid4())


class OwnerIdentity:
    """The owner id of one :class:`~leasekeeper.LeaseClient`.

    An explicit id is kept as given (the caller answers for its uniqueness). A
    default id comes from :func:`new_owner_id` and is regenerated in the child
    process after ``os.fork()``, so a client object that crosses a fork never
    acts under its parent's id.
    """

    def __init__(self, explicit: str | None = None) -> None:
        self._explicit = explicit
        self._value = explicit if explicit is not None else new_owner_id()
        if explicit is None:
            _DEFAULT_IDENTITIES.add(self)

    @property
    def value(self) -> str:
        """The owner id to send on every request."""
        return self._value

    @property
    def is_default(self) -> bool:
        """True when the id was generated (and is regenerated after a fork)."""
        return self._explicit is None

    def _regenerate(self) -> None:
        self._value = new_owner_id()


_DEFAULT_IDENTITIES: weakref.WeakSet[OwnerIdentity] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for identity in list(_DEFAULT_IDENTITIES):
        identity._regenerate()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

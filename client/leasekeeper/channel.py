"""The channel a :class:`~leasekeeper.LeaseClient` opens: its target, token and options.

The address and token come from the environment when not given (``LEASEKEEPER_TARGET``,
``LEASEKEEPER_TOKEN``, read by the ``leasekeeper`` command too); :data:`CHANNEL_OPTIONS`
finds a dead server and reconnects to a restarted one within about a second.
"""

from __future__ import annotations

import os

DEFAULT_TARGET = "127.0.0.1:9457"
TARGET_ENV = "LEASEKEEPER_TARGET"


def default_target() -> str:
    """The server address used when none is given: ``$LEASEKEEPER_TARGET``, else 127.0.0.1:9457."""
    return os.environ.get(TARGET_ENV) or DEFAULT_TARGET


DEFAULT_NAMESPACE = "default"
DEFAULT_CALL_TIMEOUT_S = 10.0
TOKEN_ENV = "LEASEKEEPER_TOKEN"
KEEPALIVE_TIME_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
# The channel's own pings find a dead server, or a connection cut on the way
# without a reset, within KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S: its calls and
# streams (watch, hold's heartbeat) then fail UNAVAILABLE. A ping goes out after
# KEEPALIVE_TIME_S without a read, on idle connections too and however long a
# stream stays quiet (the server allows a ping a second). gRPC core waits for
# the ack for ``grpc.http2.ping_timeout_ms`` (60 s unset), not for
# ``grpc.keepalive_timeout_ms``, so both are set.
#
# A server that comes back (restarted on the same address) is reconnected to
# within RECONNECT_MAX_S (+-20% jitter), not after gRPC's default backoff, which
# grows x1.6 from 1 s to 120 s and, after a 20 s outage, waited 10 s more: far
# into a lease's ttl. The first retry comes after RECONNECT_INITIAL_S. The connect
# timeout (``grpc.min_reconnect_backoff_ms``, 20 s) stays gRPC's.
RECONNECT_INITIAL_S = 0.25
RECONNECT_MAX_S = 1.0
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", round(KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", round(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.http2.ping_timeout_ms", round(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", round(RECONNECT_INITIAL_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", round(RECONNECT_MAX_S * 1000)),
)

"""The keepalive options gRPC gets: the documented defaults; a ping ack timeout to match.

gRPC core waits for a ping's ack for ``grpc.http2.ping_timeout_ms`` (60 s when
unset), not for ``grpc.keepalive_timeout_ms``; tests/fault/test_dead_peers.py
shows the effect on a black-holed connection.
"""

from __future__ import annotations

import pytest

from leasekeeper import CHANNEL_OPTIONS
from leasekeeper_server.app import server_options
from leasekeeper_server.settings import Settings

PING_OPTIONS = ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms", "grpc.http2.ping_timeout_ms")


def ping_options(options: tuple[tuple[str, int], ...]) -> dict[str, int]:
    names = [name for name, _ in options]
    assert len(names) == len(set(names)), f"an option given twice: {names}"
    return {name: value for name, value in options if name in PING_OPTIONS}


def test_server_defaults_ping_after_10_s_and_drop_after_5_s_more():
    options = server_options(Settings(_env_file=None))  # type: ignore[call-arg]
    assert ping_options(options) == {
        "grpc.keepalive_time_ms": 10_000,
        "grpc.keepalive_timeout_ms": 5_000,
        "grpc.http2.ping_timeout_ms": 5_000,
    }


def test_server_settings_reach_grpc_in_milliseconds():
    settings = Settings(_env_file=None, keepalive_time_s=2.5, keepalive_timeout_s=1.25)  # type: ignore[call-arg]
    assert ping_options(server_options(settings)) == {
        "grpc.keepalive_time_ms": 2_500,
        "grpc.keepalive_timeout_ms": 1_250,
        "grpc.http2.ping_timeout_ms": 1_250,
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [("keepalive_time_s", 0.5), ("keepalive_time_s", 7201), ("keepalive_timeout_s", 0.5)],
)
def test_server_keepalive_out_of_bounds_refused_naming_the_setting(field, value):
    with pytest.raises(ValueError, match=field):
        Settings(_env_file=None, **{field: value})  # type: ignore[call-arg]


def test_client_channel_pings_after_10_s_and_drops_after_5_s_more_on_quiet_streams_too():
    options = dict(CHANNEL_OPTIONS)
    assert ping_options(CHANNEL_OPTIONS) == {
        "grpc.keepalive_time_ms": 10_000,
        "grpc.keepalive_timeout_ms": 5_000,
        "grpc.http2.ping_timeout_ms": 5_000,
    }
    # Pings on idle connections and quiet streams (a watch), not throttled to one a minute.
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_pings_without_data"] == 0


def test_client_channel_reconnects_within_1_s_of_a_server_coming_back():
    # gRPC's default (1 s, x1.6, up to 120 s) waited 10 s more after a 20 s outage:
    # tests/fault/test_server_restart.py. Retries from 250 ms, then at most every
    # 1 s (+-20% jitter, gRPC's); the 20 s connect timeout stays gRPC's.
    options = dict(CHANNEL_OPTIONS)
    assert options["grpc.initial_reconnect_backoff_ms"] == 250
    assert options["grpc.max_reconnect_backoff_ms"] == 1_000
    assert "grpc.min_reconnect_backoff_ms" not in options

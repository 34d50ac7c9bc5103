"""Dead peers: a connection black-holed both ways is found and closed by its keepalive pings.

The fault proxy (``proxy.py``) swallows every byte both ways and closes
neither socket, as a hung middlebox does. The proxy's sockets keep
acknowledging what each side sends, so TCP (and TCP_USER_TIMEOUT, which gRPC
sets from the keepalive timeout) sees nothing wrong: only an HTTP/2 ping left
unanswered can tell. The promise is keepalive time + keepalive timeout;
gRPC core's own ping ack timeout (``grpc.http2.ping_timeout_ms``, 60 s when
unset) made it 70 s before.

Server side: the server's open-stream gauges (what an operator scrapes) drop
to 0 once it closes the connection; it runs with a short keepalive (2 s + 1 s)
to keep the test fast, and the unit test ``tests/unit/test_keepalive.py``
shows the defaults (10 s + 5 s) reach gRPC the same way. Client side: the
client's own channel, with its fixed options (10 s + 5 s), ends a watch
UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from leasekeeper import LeaseClient, LeaseUnavailable
from leasekeeper.channel import KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests import helpers
from tests.conftest import RunningServer, running_server
from tests.fault.proxy import tcp_proxy
from tests.helpers import dur

pytestmark = [pytest.mark.timeout(60)]

log = logging.getLogger(__name__)

SERVER_KEEPALIVE = {"keepalive_time_s": 2.0, "keepalive_timeout_s": 1.0}
# A loaded 2-core machine; far below gRPC's own 60 s ping ack timeout either way.
SLACK_S = 10.0
GAUGES = ("leasekeeper_heartbeat_streams_open", "leasekeeper_watch_streams_open")


def open_streams(server: RunningServer) -> dict[str, float | None]:
    """The server's open-stream gauges, by name."""
    registry = server.server.metrics.registry
    return {name: registry.get_sample_value(name) for name in GAUGES}


async def test_server_drops_black_holed_client_within_keepalive_time_plus_timeout(
    database_url: str, namespace: str
) -> None:
    lease = {"namespace": namespace, "task_id": "t", "owner_id": "a"}
    async with (
        running_server(database_url, **SERVER_KEEPALIVE) as server,
        tcp_proxy("127.0.0.1", server.port) as proxy,
        # No keepalive of its own (gRPC's default): the client never closes first.
        grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        granted = await stub.Claim(pb.ClaimRequest(**lease, ttl=dur(300)), timeout=5)
        beats: asyncio.Queue[pb.HeartbeatRequest] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.HeartbeatRequest]:
            while True:
                yield await beats.get()

        heartbeat = stub.Heartbeat(requests())
        await beats.put(pb.HeartbeatRequest(**lease, fence=granted.lease.fence, ttl=dur(300)))
        assert (await asyncio.wait_for(heartbeat.read(), 5)).renewed
        watch = stub.Watch(pb.WatchRequest(namespace=namespace, task_id="t"))
        assert (await asyncio.wait_for(watch.read(), 5)).lease.fence == granted.lease.fence

        async def both_open() -> bool:
            return open_streams(server) == dict.fromkeys(GAUGES, 1.0)

        await helpers.poll(both_open, "both streams counted open")

        proxy.black_hole("both")
        holed_at = time.monotonic()

        async def both_ended() -> bool:
            return open_streams(server) == dict.fromkeys(GAUGES, 0.0)

        promise_s = SERVER_KEEPALIVE["keepalive_time_s"] + SERVER_KEEPALIVE["keepalive_timeout_s"]
        await helpers.poll(both_ended, "the server ended both streams", promise_s + SLACK_S, 0.05)
        dropped_s = time.monotonic() - holed_at
        assert proxy.connections == 1  # the proxy closed nothing: the server's ping did
        heartbeat.cancel()
        watch.cancel()
    log.info("server: dropped the black-holed client %.2f s after the cut", dropped_s)


async def test_client_finds_black_holed_server_within_keepalive_time_plus_timeout(
    database_url: str, namespace: str
) -> None:
    async with (
        # The server's pings would not reach the client: only the client's own can tell.
        running_server(database_url) as server,
        tcp_proxy("127.0.0.1", server.port) as proxy,
        LeaseClient(f"127.0.0.1:{proxy.port}", namespace=namespace) as client,
    ):
        events = client.watch("t")
        first = await asyncio.wait_for(anext(events), 5)
        assert first.type == "SNAPSHOT"

        proxy.black_hole("both")
        holed_at = time.monotonic()
        with pytest.raises(LeaseUnavailable) as caught:
            await asyncio.wait_for(anext(events), KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S + SLACK_S)
        found_s = time.monotonic() - holed_at
        await events.aclose()
        assert proxy.connections == 1  # the proxy closed nothing: the client's ping did
    log.info("client: watch ended UNAVAILABLE %.2f s after the cut: %s", found_s, caught.value)

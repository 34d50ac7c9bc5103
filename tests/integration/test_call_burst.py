"""A burst of calls on one channel: every call reaches the service, none ends CANCELLED.

grpc.aio takes new calls from gRPC core one at a time, so a burst waits in
core; with gRPC's default bounds on that wait (1,000 calls, then a random
share cancelled up to 3,000) about one call in ten of 2,000 fired at once
ended CANCELLED without reaching the service (app.PENDING_CALLS_MAX).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.app import PENDING_CALLS_MAX

pytestmark = pytest.mark.timeout(120)

BURST = 2_000
"""Twice gRPC's default 1,000 waiting calls, where it began cancelling them."""


async def test_a_burst_of_calls_on_one_channel_all_reach_the_service(channel, stub, namespace):
    assert BURST <= PENDING_CALLS_MAX
    await channel.channel_ready()
    # An empty task id: refused INVALID_ARGUMENT by the handler before any database
    # work, so the answer says the call reached the service, and the database's
    # speed on a loaded machine plays no part.
    request = pb.ClaimRequest(namespace=namespace, task_id="", owner_id="burst")
    codes: Counter[grpc.StatusCode] = Counter()

    async def call() -> None:
        try:
            await stub.Claim(request)
        except grpc.aio.AioRpcError as error:
            codes[error.code()] += 1
        else:
            codes[grpc.StatusCode.OK] += 1

    await asyncio.gather(*(call() for _ in range(BURST)))

    assert codes == {grpc.StatusCode.INVALID_ARGUMENT: BURST}

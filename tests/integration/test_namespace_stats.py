"""GetNamespaceStats through the Python client, on a real server and PostgreSQL.

Each figure of ``LeaseClient.namespace_stats`` moves when its event happens:
a grant, a lease running out (and its expiry announced by the sweeper), a
stale fence refused, a task quarantined, an effect left reserved by a fence
that expired. The tests wait on the figures themselves (leases with short
ttls run out on the database clock), never on a fixed sleep. Tokens: the
role of ListLeases (admin) and the namespace are checked; a bad namespace is
refused naming the field. ``leasekeeper leases stats [NS]`` prints them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import grpc
import pytest

from leasekeeper import AccessDenied, InvalidArgument, LeaseClient, NamespaceStats
from leasekeeper_server.security import tokens
from tests.conftest import RunningServer, running_server
from tests.helpers import poll
from tests.integration.conftest import Worker
from tests.integration.test_cli import run_cli

pytestmark = pytest.mark.timeout(60)

SHORT_TTL_S = 0.3  # a lease that runs out while the test waits for its figure
COUNTS = (
    "leases_held",
    "leases_expired",
    "tasks_quarantined",
    "claims_last_minute",
    "stale_fences_last_minute",
    "leases_lost_last_minute",
    "effects_in_doubt",
)


def figures(stats: NamespaceStats) -> dict[str, int]:
    """The counts that are not 0, by name."""
    return {name: getattr(stats, name) for name in COUNTS if getattr(stats, name)}


async def until(
    client: LeaseClient, what: str, holds: Callable[[NamespaceStats], bool]
) -> NamespaceStats:
    """The namespace's figures, read until ``holds`` says they show ``what``."""

    async def read() -> NamespaceStats | None:
        stats = await client.namespace_stats()
        return stats if holds(stats) else None

    found: NamespaceStats = await poll(read, what)
    return found


async def test_each_figure_moves_when_its_event_happens(worker: Worker, namespace: str) -> None:
    client = worker(owner_id="w1")
    empty = await client.namespace_stats()
    assert (empty.namespace, figures(empty)) == (namespace, {})
    assert not any(getattr(empty, f"{name}_capped") for name in COUNTS)
    assert abs(empty.as_of - datetime.now(UTC)) < timedelta(minutes=5)  # database clock, UTC

    held = await client.claim("held", ttl=60)  # a grant
    stats = await client.namespace_stats()
    assert figures(stats) == {"leases_held": 1, "claims_last_minute": 1}
    assert stats.as_of >= empty.as_of

    # A lease that runs out: expired at once on the database clock, lost once announced.
    await client.claim("runs-out", ttl=SHORT_TTL_S)
    await until(client, "the lease is expired", lambda s: s.leases_expired == 1)
    stats = await until(client, "its expiry is announced", lambda s: s.leases_lost_last_minute)
    assert figures(stats) == {
        "leases_held": 1,
        "leases_expired": 1,
        "claims_last_minute": 2,
        "leases_lost_last_minute": 1,
    }

    # Taken over by another owner: held again; its old fence, checked, is stale.
    other = worker(owner_id="w2")
    taken = await other.claim("runs-out", ttl=60)
    check = await client.validate_fence("runs-out", taken.lease.fence - 1)
    assert (check.valid, check.reason) == (False, "LEASE_SUPERSEDED")
    stats = await client.namespace_stats()
    assert figures(stats) == {
        "leases_held": 2,
        "claims_last_minute": 3,
        "stale_fences_last_minute": 1,
        "leases_lost_last_minute": 1,
    }

    # A task whose one attempt runs out: quarantined.
    await client.claim("one-try", ttl=SHORT_TTL_S, max_attempts=1)
    stats = await until(client, "the task is quarantined", lambda s: s.tasks_quarantined)
    assert (stats.tasks_quarantined, stats.leases_expired) == (1, 0)

    # An effect reserved by a fence that then expired: in doubt.
    effect = await client.claim("effect", ttl=SHORT_TTL_S)
    assert effect.lease is not None
    begun = await client.begin_effect("effect", effect.lease.fence, "email", policy="ONCE")
    assert begun.decision == "PROCEED"
    stats = await until(client, "the effect is in doubt", lambda s: s.effects_in_doubt)
    assert stats.effects_in_doubt == 1
    assert held.lease is not None and stats.leases_held == 2  # "held" and the taken-over task
    assert not any(getattr(stats, f"{name}_capped") for name in COUNTS)


async def test_another_namespace_is_counted_apart(worker: Worker, server: RunningServer) -> None:
    client = worker()
    await client.claim("a", ttl=60)
    async with LeaseClient(server.target, namespace=f"{client.namespace}-other") as other:
        assert figures(await other.namespace_stats()) == {}
        stats = await other.namespace_stats(client.namespace)  # by name, from any client
    assert figures(stats) == {"leases_held": 1, "claims_last_minute": 1}


@pytest.mark.parametrize("bad", ["", "n\x00", "n" * 257, "\u200b"])
async def test_a_bad_namespace_is_invalid_argument_naming_the_field(
    worker: Worker, bad: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        await worker().namespace_stats(bad)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.field == "namespace"


async def test_the_stats_are_a_frozen_value() -> None:
    stats = NamespaceStats("ns", 1, 0, 0, 1, 0, 0, 0, datetime.now(UTC))
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.leases_held = 2  # type: ignore[misc]
    assert not stats.leases_held_capped


async def _token(db: asyncpg.Connection, role: str, *namespaces: str) -> str:
    _record, token = await tokens.create_token(db, f"{role}-stats", role, namespaces)
    return token


async def test_only_an_admin_token_covering_the_namespace_may_read_it(
    database_url: str, db: asyncpg.Connection, namespace: str
) -> None:
    admin = await _token(db, "admin", namespace)
    elsewhere = await _token(db, "admin", f"{namespace}-other")
    worker = await _token(db, "worker", namespace)
    async with running_server(database_url, auth="on") as secured:

        def client(token: str) -> LeaseClient:
            return LeaseClient(secured.target, namespace=namespace, token=token)

        async def denied(read: Callable[[], Awaitable[NamespaceStats]]) -> AccessDenied:
            with pytest.raises(AccessDenied) as refused:
                await read()
            assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
            return refused.value

        async with client(admin) as allowed, client(elsewhere) as other, client(worker) as mere:
            await allowed.claim("t", ttl=60)
            assert figures(await allowed.namespace_stats()) == {
                "leases_held": 1,
                "claims_last_minute": 1,
            }
            assert namespace in str(await denied(other.namespace_stats))
            assert "GetNamespaceStats" in str(await denied(mere.namespace_stats))
            # The token's own namespace for the other admin: allowed there.
            assert figures(await other.namespace_stats(f"{namespace}-other")) == {}


async def test_the_command_prints_the_figures(
    worker: Worker, server: RunningServer, namespace: str
) -> None:
    await worker().claim("t", ttl=60)
    target = ("--target", server.target)
    code, out, err = await run_cli("leases", "stats", namespace, *target, "--json")
    assert (code, err) == (0, "")
    assert out.endswith("\n") and out.count("\n") == 1  # one JSON object, one line
    shown = json.loads(out)
    assert set(shown) == {"namespace", "as_of", *COUNTS, *(f"{name}_capped" for name in COUNTS)}
    assert {name: shown[name] for name in COUNTS if shown[name]} == {
        "leases_held": 1,
        "claims_last_minute": 1,
    }
    assert datetime.fromisoformat(shown["as_of"]).tzinfo is not None

    code, out, err = await run_cli("leases", "stats", "-n", namespace, *target)
    assert (code, err) == (0, "")
    lines = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert list(lines) == ["namespace", "as_of", *COUNTS]
    assert (lines["namespace"], lines["leases_held"], lines["effects_in_doubt"]) == (
        namespace,
        "1",
        "0",
    )

    code, out, err = await run_cli("leases", "stats", "n\x01", *target)
    assert (code, out) == (1, "")
    assert err.startswith("leasekeeper: INVALID_ARGUMENT: ") and "namespace" in err

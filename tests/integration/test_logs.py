"""JSON logs and the audit log, from a real ``leasekeeper serve`` process.

The server runs with ``LEASEKEEPER_LOG_FORMAT=json`` and
``LEASEKEEPER_AUDIT_LOG`` set; real calls make grants, a release, losses and
a revoke, read back from the audit file; every line the server logs parses as
JSON with time, level, logger and message.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.observability.logs import json_formatter
from tests.fault.processes import server_env, server_process
from tests.helpers import poll
from tests.integration.contract_helpers import grant, heartbeat_on


def test_json_formatter_writes_the_task_fields_given_in_extra() -> None:
    record = logging.LogRecord(
        "leasekeeper.x", logging.WARNING, __file__, 1, "lost %s", ("t",), None
    )
    for field, value in {
        "namespace": "ns",
        "task_id": "t",
        "fence": 3,
        "owner_id": "owner-a",
        "expire_time": "2026-01-01T00:00:00Z",
    }.items():
        setattr(record, field, value)
    line = json.loads(json_formatter().format(record))
    assert line["level"] == "WARNING"
    assert line["logger"] == "leasekeeper.x"
    assert line["message"] == "lost t"
    assert line["time"].startswith(time.strftime("%Y", time.gmtime()))
    assert (line["namespace"], line["task_id"], line["fence"], line["owner_id"]) == (
        "ns",
        "t",
        3,
        "owner-a",
    )
    assert line["expire_time"] == "2026-01-01T00:00:00Z"


def audit_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def until_audited(path: Path, count: int) -> list[dict[str, Any]]:
    """The audit file's records once it has at least ``count`` (at most 10 s)."""

    async def enough() -> list[dict[str, Any]] | None:
        records = audit_records(path)
        return records if len(records) >= count else None

    result: list[dict[str, Any]] = await poll(enough, f"{count} audit records", within_s=10)
    return result


@pytest.mark.process
async def test_serve_writes_json_logs_and_audits_grants_losses_and_revokes(
    database_url: str, namespace: str, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    env = server_env(database_url, log_format="json", audit_log=audit, log_level="INFO")
    async with server_process(tmp_path / "logs", env) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            first = await grant(stub, namespace, "t", "owner-a", ttl_s=30.0)
            heartbeat, _ = await heartbeat_on(stub, first)
            revoked = await stub.Revoke(
                pb.RevokeRequest(namespace=namespace, task_id="t", reason="stuck worker")
            )
            assert revoked.revoked
            assert await heartbeat.code() == grpc.StatusCode.ABORTED
            second = await grant(stub, namespace, "t", "owner-b", ttl_s=30.0)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Renew(
                    pb.RenewRequest(
                        namespace=namespace, task_id="t", owner_id="owner-a", fence=first.fence
                    )
                )
            await stub.Release(
                pb.ReleaseRequest(
                    namespace=namespace, task_id="t", owner_id="owner-b", fence=second.fence
                )
            )
        records = await until_audited(audit, 6)
        log_text = server.logs()

    mine = [r for r in records if r.get("namespace") == namespace]
    for record in mine:
        assert record["logger"] == "leasekeeper.audit"
        assert record["level"] == "INFO"
        assert record["time"]
    by_event = [(r["event"], r.get("fence")) for r in mine]
    assert sorted(by_event, key=str) == sorted(
        [
            ("grant", first.fence),
            ("revoke", first.fence),
            ("loss", first.fence),  # the heartbeat stream told of the revoke
            ("grant", second.fence),
            ("loss", first.fence),  # the stale renewal
            ("release", second.fence),
        ],
        key=str,
    )
    grant_a = next(r for r in mine if r["event"] == "grant" and r["fence"] == first.fence)
    assert grant_a["task_id"] == "t"
    assert grant_a["owner_id"] == "owner-a"
    assert grant_a["expire_time"] == first.expire_time.ToJsonString()
    revoke = next(r for r in mine if r["event"] == "revoke")
    assert revoke["reason"] == "stuck worker"
    assert revoke["revoked"] is True
    losses = {r["rpc"]: r for r in mine if r["event"] == "loss"}
    assert losses["Heartbeat"]["reason"] == "LEASE_REVOKED"
    assert losses["Heartbeat"]["owner_id"] == "owner-a"
    assert losses["Renew"]["reason"] == "LEASE_SUPERSEDED"
    release = next(r for r in mine if r["event"] == "release")
    assert release["owner_id"] == "owner-b"
    assert release["complete"] is False

    lines = [
        line
        for line in log_text.splitlines()
        if line.strip() and not line.startswith("leasekeeper listening on")  # stdout's one line
    ]
    assert lines, "the server logged nothing"
    for line in lines:
        entry = json.loads(line)
        assert {"time", "level", "logger", "message"} <= entry.keys(), entry
    assert any("serving on" in json.loads(line)["message"] for line in lines)
    # audit records go to their file, not into the service's log
    assert not any(json.loads(line)["logger"] == "leasekeeper.audit" for line in lines)

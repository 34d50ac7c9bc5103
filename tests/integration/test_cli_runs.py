"""The operator commands of resumable runs, in real processes against a real server.

`history` (ListTaskHistory), `cancel` (Cancel), `retry` (Retry), the task's
attempts, state and checkpoint in `leases get|list`, and the namespace's
default attempt limit (`limits set --max-attempts`), written to the test
database and applied by a running server.
"""

from __future__ import annotations

import json
from datetime import datetime

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import claim_held, dur, error_info, poll
from tests.integration.contract_helpers import backdate
from tests.integration.test_cli import assert_aligned, run_cli, table_rows
from tests.integration.test_cli_operations import _finish, _line, _watching

HISTORY_HEADER = ["SEQUENCE", "EVENT_TIME", "KIND", "FENCE", "OWNER_ID", "ATTEMPT", "DETAILS"]


def _where(server, namespace: str) -> tuple[str, ...]:
    return ("-n", namespace, "--target", server.target)


def _fields(text: str) -> dict[str, str]:
    """``name  value`` lines (a task's details) as a dict; values may hold spaces."""
    return dict(line.split(maxsplit=1) for line in text.splitlines())


def _details_of(text: str) -> dict[str, str]:
    """A history table's KIND -> DETAILS cell (the last column, which may hold spaces)."""
    header, *lines = text.splitlines()
    kind_at, details_at = header.index("KIND"), header.index("DETAILS")
    return {line[kind_at:].split()[0]: line[details_at:].strip() for line in lines}


async def _release(stub, namespace: str, task_id: str, owner: str, fence: int, **kw) -> None:
    await stub.Release(
        pb.ReleaseRequest(namespace=namespace, task_id=task_id, owner_id=owner, fence=fence, **kw)
    )


async def _history_json(server, namespace: str, task_id: str, *more: str) -> list[dict]:
    code, out, err = await run_cli(
        "tasks", "history", task_id, *_where(server, namespace), "--json", *more
    )
    assert (code, err) == (0, "")
    return [json.loads(line) for line in out.splitlines()]


# --- history ---------------------------------------------------------------------------------


async def test_history_after_claim_and_release_prints_granted_then_released(
    server, stub, namespace
):
    fence = await claim_held(stub, namespace, "t", owner="a")
    await _release(stub, namespace, "t", "a", fence)
    code, out, err = await run_cli("tasks", "history", "t", *_where(server, namespace))
    assert (code, err) == (0, "")
    header, rows = table_rows(out)
    assert header == HISTORY_HEADER
    assert [row[2:6] for row in rows] == [["GRANTED", "1", "a", "1"], ["RELEASED", "1", "a", "-"]]
    assert int(rows[0][0]) < int(rows[1][0])  # sequence: oldest first
    assert all(row[1].endswith("Z") for row in rows)
    assert [row[6] for row in rows] == ["-", "-"]  # neither kind has details
    assert_aligned(out)


async def test_history_json_prints_one_object_per_entry_across_pages(server, stub, namespace):
    for owner in ("a", "b", "c"):
        fence = await claim_held(stub, namespace, "t", owner=owner)
        await _release(stub, namespace, "t", owner, fence)
    entries = await _history_json(server, namespace, "t", "--page-size", "2")
    assert [(e["kind"], e["fence"], e["owner_id"]) for e in entries] == [
        ("GRANTED", 1, "a"),
        ("RELEASED", 1, "a"),
        ("GRANTED", 2, "b"),
        ("RELEASED", 2, "b"),
        ("GRANTED", 3, "c"),
        ("RELEASED", 3, "c"),
    ]
    sequences = [e["sequence"] for e in entries]
    assert sequences == sorted(set(sequences))
    for entry in entries:
        assert datetime.fromisoformat(entry["event_time"]).utcoffset() is not None
        assert set(entry) >= {"attempt", "checkpoint_version", "effect_key", "reason", "method"}
    # Each release ends its lease with a release: no attempt is used up.
    assert [e["attempt"] for e in entries if e["kind"] == "GRANTED"] == [1, 1, 1]

    limited = await _history_json(server, namespace, "t", "--limit", "3", "--page-size", "2")
    assert [e["sequence"] for e in limited] == sequences[:3]


async def test_history_of_a_task_never_claimed_is_not_found_exits_1(server, namespace):
    """A mistyped task or namespace says so, as `leases get` does, not an empty table."""
    code, out, err = await run_cli("tasks", "history", "nope", *_where(server, namespace))
    assert (code, out) == (1, "")
    assert err.startswith("leasekeeper: NOT_FOUND:") and "never claimed" in err


async def test_history_details_show_the_reason_the_checkpoint_and_a_refused_fence(
    server, stub, namespace
):
    await claim_held(stub, namespace, "t", owner="a")
    code, _, _ = await run_cli(
        "revoke", "t", *_where(server, namespace), "--reason", "stuck worker"
    )
    assert code == 0
    fence = await claim_held(stub, namespace, "t", owner="b")
    await stub.SaveCheckpoint(
        pb.SaveCheckpointRequest(
            namespace=namespace,
            task_id="t",
            owner_id="b",
            fence=fence,
            checkpoint=pb.Checkpoint(version=3, data=b"page", content_type="text/plain"),
        )
    )
    check = await stub.ValidateFence(
        pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=fence - 1)
    )
    assert not check.valid

    code, out, err = await run_cli("tasks", "history", "t", *_where(server, namespace))
    assert (code, err) == (0, "")
    details = _details_of(out)
    assert details["REVOKED"] == 'reason="stuck worker"'
    assert details["CHECKPOINT_SAVED"] == "version=3 size=4B"
    assert details["FENCE_REFUSED"] == "reason=LEASE_SUPERSEDED method=ValidateFence"
    entries = await _history_json(server, namespace, "t")
    saved = next(e for e in entries if e["kind"] == "CHECKPOINT_SAVED")
    assert (saved["checkpoint_version"], saved["checkpoint_size"], saved["fence"]) == (3, 4, fence)


# --- the task's display ----------------------------------------------------------------------


async def test_leases_get_and_list_show_attempts_and_the_checkpoint(server, stub, namespace):
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30), max_attempts=3)
    )
    assert reply.acquired
    await stub.SaveCheckpoint(
        pb.SaveCheckpointRequest(
            namespace=namespace,
            task_id="t",
            owner_id="a",
            fence=reply.lease.fence,
            checkpoint=pb.Checkpoint(version=7, data=b"x" * 10, content_type="application/json"),
        )
    )
    where = _where(server, namespace)
    code, out, _ = await run_cli("leases", "get", "t", *where)
    assert code == 0
    fields = _fields(out)
    assert (fields["state"], fields["attempts"]) == ("HELD", "0/3")
    version, size, kind, by, written = fields["checkpoint"].split(", ")
    assert (version, size, kind, by) == ("version 7", "10 bytes", "application/json", "fence 1")
    assert written.endswith("Z")
    assert fields["cancel_reason"] == "-" and fields["fail_reason"] == "-"

    code, out, _ = await run_cli("leases", "get", "t", *where, "--json")
    shown = json.loads(out)
    assert (shown["attempts"], shown["max_attempts"]) == (0, 3)
    assert (shown["checkpoint_version"], shown["checkpoint_size"]) == (7, 10)

    code, out, _ = await run_cli("leases", "list", *where)
    assert code == 0
    header, rows = table_rows(out)
    assert header[-3:] == ["ATTEMPTS", "CHECKPOINT", "END_REASON"]
    assert rows[0][-3:] == ["0/3", "v7:10B", "-"]
    assert_aligned(out)


# --- cancel ----------------------------------------------------------------------------------


async def test_cancel_prints_the_cancelled_task_and_a_claim_is_refused(server, stub, namespace):
    fence = await claim_held(stub, namespace, "t", owner="a")
    where = _where(server, namespace)
    code, out, err = await run_cli("tasks", "cancel", "t", *where, "--reason", "no longer needed")
    assert (code, err) == (0, "")
    first, *rest = out.splitlines()
    assert first == "cancelled: t"
    fields = _fields("\n".join(rest))
    assert (fields["state"], fields["cancel_reason"]) == ("CANCELLED", "no longer needed")

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await claim_held(stub, namespace, "t", owner="b")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(refused.value).reason == "TASK_CANCELLED"
    check = await stub.ValidateFence(
        pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=fence)
    )
    assert not check.valid

    # Cancelling a cancelled task changes nothing, says so and exits 3; --json prints the
    # answer (cancelled false, the first reason kept).
    code, out, err = await run_cli("tasks", "cancel", "t", *where, "--reason", "again", "--json")
    assert code == 3
    assert err == (
        'leasekeeper: nothing changed: t was cancelled already (its reason stays: "no longer '
        'needed")\n'
    )
    answer = json.loads(out)
    assert answer["cancelled"] is False and out.count("\n") == 1
    lease = answer["lease"]
    assert (lease["state"], lease["fence"]) == ("CANCELLED", fence)
    assert lease["cancel_reason"] == "no longer needed"
    code, out, err = await run_cli("tasks", "cancel", "t", *where, "--reason", "third")
    assert code == 3 and err.startswith("leasekeeper: nothing changed: t was cancelled already")
    assert _fields(out)["cancel_reason"] == "no longer needed"  # no "cancelled:" headline
    entries = await _history_json(server, namespace, "t")
    cancelled = [e for e in entries if e["kind"] == "CANCELLED"]
    assert [e["reason"] for e in cancelled] == ["no longer needed"]


async def test_watch_shows_a_cancel_with_its_reason(server, stub, namespace):
    await claim_held(stub, namespace, "t", owner="a")
    where = _where(server, namespace)
    code, _, _ = await run_cli("revoke", "t", *where, "--reason", "first stop")
    assert code == 0
    async with _watching("t", *where, "--count", "2") as proc:
        assert "SNAPSHOT" in await _line(proc)
        code, _, _ = await run_cli("tasks", "cancel", "t", *where, "--reason", "given up")
        assert code == 0
        code, out, err = await _finish(proc)
    assert (code, err) == (0, "")
    # The cancel's reason, not the earlier revoke's; quoted, as it holds a space.
    assert out.split(maxsplit=6)[1:] == [
        "CANCELLED",
        "t",
        "fence=1",
        "owner=a",
        "state=CANCELLED",
        'reason="given up"\n',
    ]


async def test_cancel_of_a_completed_task_prints_failed_precondition_exits_1(
    server, stub, namespace
):
    fence = await claim_held(stub, namespace, "t", owner="a")
    await _release(stub, namespace, "t", "a", fence, complete=True)
    code, out, err = await run_cli(
        "tasks", "cancel", "t", *_where(server, namespace), "--reason", "x"
    )
    assert (code, out) == (1, "")
    assert err.startswith("leasekeeper: FAILED_PRECONDITION:") and err.count("\n") == 1
    reply = await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="t"))
    assert reply.lease.state == pb.TASK_STATE_COMPLETED


@pytest.mark.parametrize("command", ["cancel", "retry"])
async def test_cancel_or_retry_unknown_task_prints_not_found_exits_1(server, namespace, command):
    code, out, err = await run_cli(
        "tasks", command, "nope", *_where(server, namespace), "--reason", "x"
    )
    assert (code, out) == (1, "")
    assert err.startswith("leasekeeper: NOT_FOUND:") and err.count("\n") == 1


@pytest.mark.parametrize("command", ["cancel", "retry"])
async def test_cancel_or_retry_without_a_reason_is_a_usage_error_exit_2(server, namespace, command):
    code, out, err = await run_cli("tasks", command, "t", *_where(server, namespace))
    assert (code, out) == (2, "")
    assert "--reason" in err and "Traceback" not in err


# --- retry -----------------------------------------------------------------------------------


async def test_retry_of_a_task_not_quarantined_fails_saying_so_exits_1(server, stub, namespace):
    await claim_held(stub, namespace, "t", owner="a")
    code, out, err = await run_cli(
        "tasks", "retry", "t", *_where(server, namespace), "--reason", "x"
    )
    assert (code, out) == (1, "")
    assert err.startswith("leasekeeper: FAILED_PRECONDITION:") and err.count("\n") == 1
    assert "quarantined" in err.lower() and "HELD" in err, err
    reply = await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="t"))
    assert (reply.lease.state, reply.lease.owner_id) == (pb.TASK_STATE_HELD, "a")


async def test_retry_puts_a_quarantined_task_back_and_the_next_claim_is_granted(
    server, stub, db, namespace
):
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30), max_attempts=1)
    )
    assert reply.acquired
    await backdate(db, namespace, "t")  # its only attempt ends without a release
    where = _where(server, namespace)
    code, out, _ = await run_cli("leases", "get", "t", *where)
    assert code == 0
    fields = _fields(out)
    assert (fields["state"], fields["attempts"]) == ("QUARANTINED", "1/1")
    code, out, _ = await run_cli("leases", "list", *where, "--state", "QUARANTINED", "--json")
    assert [x["task_id"] for x in map(json.loads, out.splitlines())] == ["t"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await claim_held(stub, namespace, "t", owner="b")
    assert error_info(refused.value).reason == "TASK_QUARANTINED"

    code, out, err = await run_cli("tasks", "retry", "t", *where, "--reason", "vendor is back")
    assert (code, err) == (0, "")
    first, *rest = out.splitlines()
    assert first == "retried: t"
    fields = _fields("\n".join(rest))
    assert fields["state"] == "FREE" and fields["attempts"].startswith("0")
    assert await claim_held(stub, namespace, "t", owner="b") == reply.lease.fence + 1

    # The ended attempt is in the history (QUARANTINED if the sweeper announced it first,
    # else EXPIRED just before the retry), then the retry, then a first attempt again.
    entries = await _history_json(server, namespace, "t")
    assert [e["kind"] for e in entries[-2:]] == ["RETRIED", "GRANTED"]
    assert entries[-2]["reason"] == "vendor is back"
    assert (entries[-1]["fence"], entries[-1]["attempt"]) == (reply.lease.fence + 1, 1)
    assert {"QUARANTINED", "EXPIRED"} & {e["kind"] for e in entries[:-2]}


# --- limits set --max-attempts ---------------------------------------------------------------


def _db_env(database_url: str) -> dict[str, str]:
    return {"LEASEKEEPER_DATABASE_URL": database_url}


async def _limits_row(db, namespace: str):
    return await db.fetchrow(
        "SELECT * FROM leasekeeper_namespace_limits WHERE namespace = $1", namespace
    )


async def test_limits_set_max_attempts_round_trips(database_url, db, namespace):
    env = _db_env(database_url)
    code, out, err = await run_cli("limits", "set", namespace, "--max-attempts", "3", env=env)
    assert code == 0, err
    assert _fields(out)["max_attempts"] == "3"
    assert (await _limits_row(db, namespace))["max_attempts"] == 3

    code, out, _ = await run_cli("limits", "list", env=env)
    header, rows = table_rows(out)
    mine = dict(zip(header, next(r for r in rows if r[0] == namespace), strict=True))
    assert (mine["MAX_ATTEMPTS"], mine["MAX_LEASES"]) == ("3", "-")
    assert_aligned(out)
    code, out, _ = await run_cli("limits", "list", "--json", env=env)
    listed = {x["namespace"]: x for x in map(json.loads, out.splitlines())}
    assert listed[namespace]["max_attempts"] == 3

    # Setting another limit keeps it; clearing it keeps the others.
    assert (await run_cli("limits", "set", namespace, "--max-leases", "5", env=env))[0] == 0
    assert (await _limits_row(db, namespace))["max_attempts"] == 3
    code, out, _ = await run_cli("limits", "clear", namespace, "--max-attempts", "--json", env=env)
    assert code == 0
    assert (json.loads(out)["max_attempts"], json.loads(out)["max_leases"]) == (None, 5)
    # The last limit cleared: no row.
    assert (await run_cli("limits", "clear", namespace, "--max-leases", env=env))[0] == 0
    assert await _limits_row(db, namespace) is None
    assert (await run_cli("limits", "set", namespace, "--max-attempts", "2", env=env))[0] == 0
    assert (await run_cli("limits", "clear", namespace, "--max-attempts", env=env))[0] == 0
    assert await _limits_row(db, namespace) is None


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "many", "1000001"])
async def test_limits_set_bad_max_attempts_exit_2_naming_it_and_change_nothing(
    database_url, db, namespace, value
):
    code, out, err = await run_cli(
        "limits", "set", namespace, "--max-attempts", value, env=_db_env(database_url)
    )
    assert (code, out) == (2, "")
    assert "--max-attempts" in err and "Traceback" not in err
    assert await _limits_row(db, namespace) is None


async def test_limits_max_attempts_is_the_limit_of_claims_that_send_none(
    database_url, server, stub, namespace
):
    code, _, _ = await run_cli(
        "limits", "set", namespace, "--max-attempts", "2", env=_db_env(database_url)
    )
    assert code == 0

    async def loaded() -> bool:
        return server.server.limits.get(namespace).max_attempts == 2

    await poll(loaded, f"max_attempts of {namespace} loaded by the server")
    default = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t1", owner_id="a", ttl=dur(30))
    )
    own = await stub.Claim(
        pb.ClaimRequest(
            namespace=namespace, task_id="t2", owner_id="a", ttl=dur(30), max_attempts=5
        )
    )
    assert (default.lease.max_attempts, own.lease.max_attempts) == (2, 5)
    code, out, _ = await run_cli("leases", "get", "t1", *_where(server, namespace))
    assert (code, _fields(out)["attempts"]) == (0, "0/2")


async def test_tasks_history_takes_the_namespace_positionally_too(server, stub, namespace):
    """`leasekeeper tasks history NS TASK` as well as `tasks history TASK -n NS`."""
    await claim_held(stub, namespace, "t", owner="a")
    target = ("--target", server.target)
    code, out, err = await run_cli("tasks", "history", namespace, "t", *target, "--json")
    assert (code, err) == (0, "")
    assert [json.loads(line)["kind"] for line in out.splitlines()] == ["GRANTED"]
    code, out, err = await run_cli("tasks", "history", namespace, "t", "extra", *target)
    assert (code, out) == (2, "") and "[NAMESPACE] TASK_ID" in err

"""The operator commands `revoke`, `watch`, `tokens` and `limits`, in real processes.

`revoke` and `watch` call a real server on a loopback port; `tokens` and
`limits` write the test database directly (LEASEKEEPER_DATABASE_URL), as an
operator's shell would.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from datetime import timedelta

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.security import tokens
from tests.conftest import running_server
from tests.helpers import claim_held
from tests.integration.contract_helpers import limits_loaded
from tests.integration.test_cli import assert_aligned, run_cli, store_held, table_rows
from tests.integration.test_tls import Authority

LINE_TIMEOUT_S = 15.0


# --- revoke ----------------------------------------------------------------------------------


async def test_revoke_held_lease_prints_revoked_and_its_fence_stops_validating(
    server, stub, namespace
):
    fence = await claim_held(stub, namespace, "t")
    code, out, err = await run_cli(
        "revoke", "t", "-n", namespace, "--reason", "stuck worker", "--target", server.target
    )
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"revoked: t fence {fence}"
    fields = dict(line.split(maxsplit=1) for line in lines[1:])
    assert fields["revoke_reason"] == "stuck worker"
    assert fields["end_reason"] == "LEASE_REVOKED"
    check = await stub.ValidateFence(
        pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=fence)
    )
    assert not check.valid and check.reason == pb.LOSS_REASON_LEASE_REVOKED


async def test_revoke_json_prints_the_outcome_and_the_lease(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    where = ("-n", namespace, "--target", server.target, "--json")
    code, out, _ = await run_cli("revoke", "t", "--reason", "drain", *where)
    assert code == 0
    answer = json.loads(out)
    assert answer["revoked"] is True
    assert (answer["lease"]["task_id"], answer["lease"]["fence"]) == ("t", 1)
    assert answer["lease"]["revoke_reason"] == "drain"
    # Nothing left to revoke: the answer on stdout, exit 3, and why on stderr.
    code, out, err = await run_cli("revoke", "t", "--reason", "again", *where)
    assert code == 3
    assert json.loads(out)["revoked"] is False and out.count("\n") == 1
    why = "t holds no lease to revoke (state FREE, current fence 1)"
    assert err == f"leasekeeper: nothing changed: {why}\n"


async def test_revoke_other_fence_leaves_the_current_lease_alone(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    code, out, err = await run_cli(
        "revoke", "t", "-n", namespace, "--reason", "x", "--fence", "2", "--target", server.target
    )
    assert code == 3
    assert err.startswith("leasekeeper: nothing changed: t fence 2 holds no lease to revoke")
    assert err.count("\n") == 1
    fields = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert (fields["state"], fields["fence"], fields["revoke_reason"]) == ("HELD", "1", "-")
    reply = await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="t"))
    assert (reply.lease.state, reply.lease.fence) == (pb.TASK_STATE_HELD, 1)


async def test_revoke_unknown_task_prints_not_found_exits_1(server, namespace):
    code, out, err = await run_cli(
        "revoke", "nope", "-n", namespace, "--reason", "x", "--target", server.target
    )
    assert (code, out) == (1, "")
    assert err.startswith("leasekeeper: NOT_FOUND:") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ((), "--reason"),
        (("--reason", "x", "--fence", "0"), "--fence"),
        (("--reason", "x", "--fence", "one"), "--fence"),
    ],
)
async def test_revoke_bad_options_are_usage_errors_exit_2(server, namespace, args, named):
    code, _, err = await run_cli("revoke", "t", "-n", namespace, "--target", server.target, *args)
    assert code == 2
    assert named in err and "Traceback" not in err


# --- watch -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _watching(*args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`leasekeeper watch ARGS` in a process, its stdout readable line by line; killed on exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("LEASEKEEPER_TARGET",)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "leasekeeper_server.cli.main",
        "watch",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), LINE_TIMEOUT_S)
    assert line, "the watch ended before printing a line"
    return line.decode().rstrip("\n")


async def _finish(proc: asyncio.subprocess.Process) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(proc.communicate(), LINE_TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_watch_task_prints_snapshot_then_each_event_and_stops_after_count(
    server, stub, namespace
):
    await claim_held(stub, namespace, "t", owner="a")
    async with _watching("t", "-n", namespace, "--target", server.target, "--count", "3") as proc:
        # The SNAPSHOT comes after the server subscribed: later changes cannot be missed.
        snapshot = (await _line(proc)).split()
        assert snapshot[1:] == ["SNAPSHOT", "t", "fence=1", "owner=a", "state=HELD"]
        assert snapshot[0].endswith("Z")
        await stub.Release(
            pb.ReleaseRequest(namespace=namespace, task_id="t", owner_id="a", fence=1)
        )
        await claim_held(stub, namespace, "t", owner="b")
        code, out, err = await _finish(proc)
    assert (code, err) == (0, "")
    assert [line.split()[1:] for line in out.splitlines()] == [
        ["RELEASED", "t", "fence=1", "owner=a", "state=FREE"],
        ["CLAIMED", "t", "fence=2", "owner=b", "state=HELD"],
    ]


async def test_watch_namespace_json_count_2_sees_a_claim_and_its_release(server, stub, namespace):
    where = ("-n", namespace, "--target", server.target, "--json")
    async with _watching(*where, "--count", "2") as proc:
        # A namespace watch starts without a SNAPSHOT: claim and release new tasks until it
        # has printed two events (bounded); each pair is CLAIMED then RELEASED.
        assert proc.stdout is not None
        for i in range(50):
            fence = await claim_held(stub, namespace, f"t{i}")
            await stub.Release(
                pb.ReleaseRequest(namespace=namespace, task_id=f"t{i}", owner_id="w", fence=fence)
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.2)
            if proc.returncode is not None:
                break
        code, out, err = await _finish(proc)
    assert (code, err) == (0, "")
    events = [json.loads(line) for line in out.splitlines()]
    assert len(events) == 2
    assert {e["type"] for e in events} <= {"CLAIMED", "RELEASED"}
    for event in events:
        assert event["lease"]["namespace"] == namespace
        assert event["event_time"] is not None
        expected_state = "HELD" if event["type"] == "CLAIMED" else "FREE"
        assert event["lease"]["state"] == expected_state


async def test_watch_shows_a_revoke_with_its_reason(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    where = ("-n", namespace, "--target", server.target)
    async with _watching("t", *where, "--count", "2", "--json") as proc:
        assert json.loads(await _line(proc))["type"] == "SNAPSHOT"
        code, _, _ = await run_cli("revoke", "t", *where, "--reason", "moved to ops")
        assert code == 0
        code, out, _ = await _finish(proc)
    assert code == 0
    event = json.loads(out)
    assert event["type"] == "REVOKED"
    assert (event["lease"]["fence"], event["lease"]["revoke_reason"]) == (1, "moved to ops")


async def test_watch_line_shows_a_stored_bidi_owner_escaped(server, db, namespace):
    await store_held(db, namespace, "t", "\u202ew-evil")  # stored before the id rule
    where = ("-n", namespace, "--target", server.target)
    async with _watching("t", *where, "--timeout", "0.5") as proc:
        code, out, err = await _finish(proc)
    assert (code, err) == (0, "")
    assert out.split()[1:] == ["SNAPSHOT", "t", "fence=1", "owner=\\u202ew-evil", "state=HELD"]


async def test_watch_ctrl_c_ends_cleanly_exit_0(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    async with _watching("t", "-n", namespace, "--target", server.target) as proc:
        assert "SNAPSHOT" in await _line(proc)
        proc.send_signal(signal.SIGINT)
        code, out, err = await _finish(proc)
    assert (code, out, err) == (0, "", "")


async def test_watch_timeout_ends_the_watch_exit_0(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    where = ("-n", namespace, "--target", server.target)
    async with _watching("t", *where, "--timeout", "0.5") as proc:
        code, out, err = await _finish(proc)
    assert (code, err) == (0, "")
    assert [line.split()[1] for line in out.splitlines()] == ["SNAPSHOT"]


async def test_watch_unreachable_server_prints_one_line_exits_1(unused_tcp_port):
    async with _watching("-n", "ns", "--target", f"127.0.0.1:{unused_tcp_port}") as proc:
        code, out, err = await _finish(proc)
    assert (code, out) == (1, "")
    assert err.startswith("leasekeeper: UNAVAILABLE:") and err.count("\n") == 1


# --- tokens ----------------------------------------------------------------------------------


def _db_env(database_url: str) -> dict[str, str]:
    return {"LEASEKEEPER_DATABASE_URL": database_url}


async def test_tokens_create_list_revoke_round_trip(database_url, db, namespace):
    env = _db_env(database_url)
    name = f"ops-{namespace}"
    code, out, err = await run_cli(
        "tokens",
        "create",
        "--name",
        name,
        "--role",
        "admin",
        "--namespace",
        namespace,
        "--namespace",
        "team-a/*",
        "--json",
        env=env,
    )
    assert code == 0, err
    assert "not stored" in err
    created = json.loads(out)
    token, token_id = created["token"], created["token_id"]
    assert token.startswith(f"lk_{token_id}_")
    assert (created["name"], created["role"]) == (name, "admin")
    assert created["namespaces"] == [namespace, "team-a/*"]

    row = await db.fetchrow("SELECT * FROM leasekeeper_tokens WHERE token_id = $1", token_id)
    assert bytes(row["token_sha256"]) == hashlib.sha256(token.encode()).digest()
    secret = token.split("_", 2)[2]  # lk_<id>_<secret>: the secret may hold "_"
    assert all(secret not in str(value) for value in row.values())
    assert row["revoke_time"] is None and row["expire_time"] is None

    for json_flag in ((), ("--json",)):
        code, out, _ = await run_cli("tokens", "list", *json_flag, env=env)
        assert code == 0
        assert token_id in out and secret not in out
    code, out, _ = await run_cli("tokens", "list", env=env)
    header, rows = table_rows(out)
    assert header == [
        "TOKEN_ID",
        "NAME",
        "ROLE",
        "NAMESPACES",
        "STATUS",
        "CREATE_TIME",
        "EXPIRE_TIME",
        "REVOKE_TIME",
    ]
    mine = next(r for r in rows if r[0] == token_id)
    assert mine[1:5] == [name, "admin", f"{namespace},team-a/*", "active"]
    assert mine[-1] == "-"
    assert_aligned(out)

    code, out, _ = await run_cli("tokens", "revoke", token_id, env=env)
    assert (code, out) == (0, f"revoked token {token_id}\n")
    assert await db.fetchval(
        "SELECT revoke_time IS NOT NULL FROM leasekeeper_tokens WHERE token_id = $1", token_id
    )
    code, out, _ = await run_cli("tokens", "list", "--json", env=env)
    listed = {x["token_id"]: x for x in map(json.loads, out.splitlines())}
    assert listed[token_id]["status"] == "revoked"
    assert listed[token_id]["revoke_time"] is not None
    # Revoking again changes nothing: exit 3, saying so; --json prints the token.
    code, out, err = await run_cli("tokens", "revoke", token_id, env=env)
    assert (code, out) == (3, "")
    assert err.startswith(f"leasekeeper: nothing changed: token {token_id} was revoked already")
    code, out, err = await run_cli("tokens", "revoke", token_id, "--json", env=env)
    assert code == 3 and err.count("\n") == 1
    shown = json.loads(out)
    assert (shown["token_id"], shown["status"]) == (token_id, "revoked")
    assert shown["revoke_time"] == listed[token_id]["revoke_time"]
    # An id no token has is an error.
    code, out, err = await run_cli("tokens", "revoke", "nosuchid", env=env)
    assert (code, out) == (1, "")
    assert err == "leasekeeper: no token with id 'nosuchid'\n"


async def test_tokens_create_expires_in_sets_expire_time_on_the_database_clock(
    database_url, db, namespace
):
    code, out, err = await run_cli(
        "tokens",
        "create",
        "--name",
        f"short-{namespace}",
        "--role",
        "worker",
        "--namespace",
        namespace,
        "--expires-in",
        "3600",
        env=_db_env(database_url),
    )
    assert code == 0, err
    fields = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert fields["token"].startswith(f"lk_{fields['token_id']}_")
    assert fields["status"] == "active" and fields["expire_time"].endswith("Z")
    row = await db.fetchrow(
        "SELECT create_time, expire_time FROM leasekeeper_tokens WHERE token_id = $1",
        fields["token_id"],
    )
    lifetime = row["expire_time"] - row["create_time"]
    assert timedelta(seconds=3599) < lifetime <= timedelta(seconds=3600)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--role", "root", "--namespace", "ns"), "--role"),
        (("--role", "worker", "--namespace", "a*b"), "--namespace"),
        (("--role", "worker", "--namespace", " "), "--namespace"),  # the rule of every id
        (("--role", "worker", "--namespace", "team-\u202e*"), "--namespace"),
        (("--role", "worker", "--namespace", "\u200b"), "--namespace"),  # nothing visible
        (("--role", "worker", "--namespace", "team\u2028*"), "--namespace"),  # breaks lines
        (("--role", "worker", "--namespace", "ns", "--expires-in", "0"), "--expires-in"),
        (("--role", "worker", "--namespace", "ns", "--expires-in", "-5"), "--expires-in"),
        (("--role", "worker"), "--namespace"),
    ],
)
async def test_tokens_create_bad_options_exit_2_naming_the_option(
    database_url, db, namespace, args, named
):
    name = f"bad-{namespace}"
    code, out, err = await run_cli(
        "tokens", "create", "--name", name, *args, env=_db_env(database_url)
    )
    assert (code, out) == (2, "")
    assert named in err and "Traceback" not in err
    assert await db.fetchval("SELECT count(*) FROM leasekeeper_tokens WHERE name = $1", name) == 0


@pytest.mark.parametrize(
    "suffix",
    ["\u202e", "\u2028", "\x85", "\x7f", "\u200b"],
    ids=["bidi-override", "line-separator", "c1-control", "delete", "invisible-alone"],
)
async def test_tokens_create_unreadable_name_exit_2_naming_it(database_url, db, namespace, suffix):
    # The name is shown in logs: the character rule of ids. "\u200b" stands alone.
    name = suffix if suffix == "\u200b" else f"bad-{namespace}{suffix}x"
    code, out, err = await run_cli(
        "tokens",
        "create",
        "--name",
        name,
        "--role",
        "worker",
        "--namespace",
        "ns",
        env=_db_env(database_url),
    )
    assert (code, out) == (2, "")
    assert "--name" in err and "Traceback" not in err, err
    assert await db.fetchval("SELECT count(*) FROM leasekeeper_tokens WHERE name = $1", name) == 0


# --- limits ----------------------------------------------------------------------------------


async def _limits_row(db, namespace: str):
    return await db.fetchrow(
        "SELECT * FROM leasekeeper_namespace_limits WHERE namespace = $1", namespace
    )


async def test_limits_set_list_clear_round_trip(database_url, db, namespace):
    env = _db_env(database_url)
    code, out, err = await run_cli(
        "limits",
        "set",
        namespace,
        "--max-leases",
        "5",
        "--claims-per-second",
        "2.5",
        "--burst",
        "4",
        "--lock-delay",
        "1.5",
        env=env,
    )
    assert code == 0, err
    fields = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert fields["max_leases"] == "5" and fields["lock_delay"] == "1.5s"
    row = await _limits_row(db, namespace)
    assert (row["max_leases"], row["claims_per_second"], row["claim_burst"]) == (5, 2.5, 4.0)
    assert row["lock_delay"] == timedelta(seconds=1.5)

    code, out, _ = await run_cli("limits", "list", env=env)
    assert code == 0
    header, rows = table_rows(out)
    assert header == [
        "NAMESPACE",
        "MAX_LEASES",
        "CLAIMS_PER_SECOND",
        "BURST",
        "LOCK_DELAY",
        "MAX_ATTEMPTS",
        "UPDATE_TIME",
    ]
    assert next(r for r in rows if r[0] == namespace)[1:5] == ["5", "2.5", "4", "1.5s"]
    assert_aligned(out)
    code, out, _ = await run_cli("limits", "list", "--json", env=env)
    listed = {x["namespace"]: x for x in map(json.loads, out.splitlines())}
    assert listed[namespace]["lock_delay"] == 1.5 and listed[namespace]["burst"] == 4.0

    # Clearing the rate takes its burst along and keeps the rest.
    code, _, _ = await run_cli("limits", "clear", namespace, "--claims-per-second", env=env)
    assert code == 0
    row = await _limits_row(db, namespace)
    assert (row["max_leases"], row["claims_per_second"], row["claim_burst"]) == (5, None, None)
    assert row["lock_delay"] == timedelta(seconds=1.5)

    code, out, _ = await run_cli(
        "limits", "clear", namespace, "--max-leases", "--lock-delay", "--json", env=env
    )
    assert code == 0
    assert json.loads(out) == {"namespace": namespace, "limits": None}
    assert await _limits_row(db, namespace) is None  # nothing left: no row


async def test_limits_set_changes_only_the_given_limits(database_url, db, namespace):
    env = _db_env(database_url)
    assert (await run_cli("limits", "set", namespace, "--max-leases", "3", env=env))[0] == 0
    assert (await run_cli("limits", "set", namespace, "--lock-delay", "2", env=env))[0] == 0
    row = await _limits_row(db, namespace)
    assert (row["max_leases"], row["lock_delay"]) == (3, timedelta(seconds=2))
    assert row["claims_per_second"] is None
    code, _, _ = await run_cli("limits", "clear", namespace, "--all", env=env)
    assert code == 0
    assert await _limits_row(db, namespace) is None


async def test_limits_set_resets_the_claim_bucket_only_when_the_rate_changes(
    database_url, db, namespace
):
    env = _db_env(database_url)
    assert (await run_cli("limits", "set", namespace, "--claims-per-second", "2", env=env))[0] == 0
    await db.execute(
        "UPDATE leasekeeper_namespace_limits SET bucket_tokens = 0.5, "
        "bucket_time = clock_timestamp() WHERE namespace = $1",
        namespace,
    )
    assert (await run_cli("limits", "set", namespace, "--max-leases", "7", env=env))[0] == 0
    assert (await _limits_row(db, namespace))["bucket_tokens"] == 0.5
    # The same rate: nothing changed (exit 3), the bucket kept.
    assert (await run_cli("limits", "set", namespace, "--claims-per-second", "2", env=env))[0] == 3
    assert (await _limits_row(db, namespace))["bucket_tokens"] == 0.5
    assert (await run_cli("limits", "set", namespace, "--claims-per-second", "3", env=env))[0] == 0
    row = await _limits_row(db, namespace)
    assert (row["bucket_tokens"], row["bucket_time"]) == (None, None)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--max-leases", "-1"), "--max-leases"),
        (("--max-leases", "1.5"), "--max-leases"),
        (("--max-leases", "3000000000"), "--max-leases"),
        (("--claims-per-second", "0"), "--claims-per-second"),
        (("--claims-per-second", "nan"), "--claims-per-second"),
        (("--claims-per-second", "inf"), "--claims-per-second"),
        (("--burst", "0.5", "--claims-per-second", "1"), "--burst"),
        (("--burst", "3"), "--burst"),  # a bucket without a rate
        (("--lock-delay", "-0.1"), "--lock-delay"),
        (("--lock-delay", "ten"), "--lock-delay"),
        ((), "limits set"),  # nothing to set
    ],
)
async def test_limits_set_bad_values_exit_2_naming_the_option_and_change_nothing(
    database_url, db, namespace, args, named
):
    code, out, err = await run_cli("limits", "set", namespace, *args, env=_db_env(database_url))
    assert (code, out) == (2, "")
    assert named in err and err.count("\n") <= 5 and "Traceback" not in err
    assert await _limits_row(db, namespace) is None


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (" ", "must not be only whitespace"),
        ("ns\u2067x\u2069", "contains bidirectional control character U+2067"),
        ("\u200b\u3164", "must hold a visible character"),
        ("ns\u2028x", "contains line separator U+2028"),
    ],
    ids=["whitespace", "bidi-isolate", "invisible", "line-separator"],
)
async def test_limits_set_unreadable_namespace_exit_2_naming_it(database_url, db, bad, why):
    code, out, err = await run_cli(
        "limits", "set", bad, "--max-leases", "3", env=_db_env(database_url)
    )
    assert (code, out) == (2, "")
    assert f"namespace: {why}" in err, err
    assert "Traceback" not in err
    assert await _limits_row(db, bad) is None


async def test_limits_clear_without_a_limit_is_a_usage_error(database_url, namespace):
    code, _, err = await run_cli("limits", "clear", namespace, env=_db_env(database_url))
    assert code == 2
    assert "limits clear" in err


async def test_limits_set_is_applied_by_a_running_server(database_url, server, stub, namespace):
    await claim_held(stub, namespace, "first")
    code, _, _ = await run_cli(
        "limits", "set", namespace, "--max-leases", "1", env=_db_env(database_url)
    )
    assert code == 0
    await limits_loaded(server, namespace)  # reloaded on the database's notification
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await claim_held(stub, namespace, "more")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# --- access: tokens and TLS ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _guarded_server(database_url: str, folder, tls: bool) -> AsyncIterator[dict]:
    """A server requiring tokens (an admin and a worker token in a token file), maybe mTLS.

    Yields the target, the tokens, and the CLI's TLS options.
    """
    admin, worker = tokens.new_token()[1], tokens.new_token()[1]
    token_file = folder / "tokens.toml"
    token_file.write_text(
        tokens.file_entry(admin, "cli-admin", "admin", ["*"])
        + tokens.file_entry(worker, "cli-worker", "worker", ["*"])
    )
    overrides: dict = {"auth": "on", "tokens_file": token_file}
    tls_options: tuple[str, ...] = ()
    if tls:
        server_ca, client_ca = Authority.make("server-ca"), Authority.make("client-ca")
        paths = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key", "ccert", "ckey")}
        paths["ca"].write_bytes(server_ca.pem)
        key_pem, cert_pem = server_ca.issue("leasekeeper", server=True)
        paths["key"].write_bytes(key_pem)
        paths["cert"].write_bytes(cert_pem)
        key_pem, cert_pem = client_ca.issue("operator", server=False)
        paths["ckey"].write_bytes(key_pem)
        paths["ccert"].write_bytes(cert_pem)
        client_ca_file = folder / "client-ca.pem"
        client_ca_file.write_bytes(client_ca.pem)
        overrides.update(
            tls_cert_file=paths["cert"],
            tls_key_file=paths["key"],
            tls_client_ca_file=client_ca_file,
        )
        tls_options = (
            "--tls-ca",
            str(paths["ca"]),
            "--tls-cert",
            str(paths["ccert"]),
            "--tls-key",
            str(paths["ckey"]),
        )
    async with running_server(database_url, **overrides) as running:
        yield {"target": running.target, "admin": admin, "worker": worker, "tls": tls_options}


async def test_token_option_and_environment_authorize_calls(database_url, tmp_path, namespace):
    async with _guarded_server(database_url, tmp_path, tls=False) as guarded:
        where = ("-n", namespace, "--target", guarded["target"], "--json")
        code, out, err = await run_cli("leases", "list", *where)
        assert (code, out) == (1, "")
        assert err.startswith("leasekeeper: UNAUTHENTICATED:") and err.count("\n") == 1
        # The namespace holds no tasks: said on stderr, with those the token covers.
        empty = f'leasekeeper: namespace "{namespace}" holds no tasks; namespaces with tasks'
        code, _, err = await run_cli("leases", "list", *where, "--token", guarded["admin"])
        assert code == 0 and err.startswith(f"{empty} that the token covers: ")
        assert err.count("\n") == 1
        code, _, err = await run_cli(
            "leases", "list", *where, env={"LEASEKEEPER_TOKEN": guarded["admin"]}
        )
        assert code == 0 and err.startswith(f"{empty} that the token covers: ")
        assert err.count("\n") == 1
        # A worker token may not revoke.
        code, _, err = await run_cli(
            "revoke", "t", *where, "--reason", "x", "--token", guarded["worker"]
        )
        assert code == 1 and err.startswith("leasekeeper: PERMISSION_DENIED:")


async def test_tls_options_reach_a_mutual_tls_server(database_url, tmp_path, namespace):
    async with _guarded_server(database_url, tmp_path, tls=True) as guarded:
        where = ("-n", namespace, "--target", guarded["target"], "--token", guarded["admin"])
        code, out, err = await run_cli("leases", "list", *where, *guarded["tls"])
        assert code == 0 and err.startswith(f'leasekeeper: namespace "{namespace}" holds no')
        assert out.split() == [
            "TASK_ID",
            "STATE",
            "FENCE",
            "OWNER_ID",
            "REMAINING_TTL",
            "EXPIRE_TIME",
            "CLAIM_TIME",
            "ATTEMPTS",
            "CHECKPOINT",
            "END_REASON",
        ]
        # Without a client certificate the handshake fails: one line, exit 1.
        code, _, err = await run_cli("leases", "list", *where, *guarded["tls"][:2])
        assert code == 1 and err.startswith("leasekeeper: UNAVAILABLE:")
        assert err.count("\n") == 1
        # A certificate without its key is a usage error.
        code, _, err = await run_cli("leases", "list", *where, *guarded["tls"][:4])
        assert code == 2 and "--tls-key" in err
        # A plain channel to a TLS port fails too.
        code, _, err = await run_cli("leases", "list", *where)
        assert code == 1 and err.count("\n") == 1

"""The `leasekeeper` command's habits, in real processes against a real server and database.

* Where revoke (or cancel, retry) is listed or suggested, it is shown with
  its ``--reason``; the top-level help lists every command and the exit codes.
* ``--json`` prints JSON Lines everywhere: exactly one JSON object per line on
  standard output, nothing else.
* A command that changed nothing says so on standard error and exits 3.
* The namespace comes first, positionally, or with ``-n``.
* ``leases list`` of a namespace without tasks names the namespaces that
  have some; ``namespaces`` lists them with their task counts.
* ``watch`` shows an event's own reason, never one an earlier event left on
  the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import claim_held, dur
from tests.integration.test_cli import assert_aligned, run_cli, table_rows
from tests.integration.test_cli_operations import _finish, _line, _watching

UNCHANGED = 3


def json_lines(out: str) -> list[dict]:
    """Standard output as JSON Lines: every line one JSON object, nothing else."""
    assert out.endswith("\n"), out
    lines = out[:-1].split("\n")
    objects = [json.loads(line) for line in lines]
    assert all(isinstance(o, dict) for o in objects), out
    return objects


def fields(text: str) -> dict[str, str]:
    """``name  value`` lines (a task's details) as a dict; values may hold spaces."""
    return dict(line.split(maxsplit=1) for line in text.splitlines())


# --- help: revoke with its --reason, every command, the exit codes --------------------------


async def test_top_level_help_lists_every_command_with_revoke_and_its_reason_and_exit_codes():
    code, out, err = await run_cli("--help")
    assert (code, err) == (0, "")
    assert "revoke [NS] TASK_ID --reason TEXT" in out
    assert "tasks cancel [NS] TASK_ID --reason TEXT" in out
    assert "tasks retry [NS] TASK_ID --reason TEXT" in out
    for command in ("leases list [NS]", "watch [NS [TASK_ID]]", "namespaces", "limits set NS"):
        assert command in out, command
    codes = out[out.index("exit codes:") :]
    for code_line in ("  0 ", "  1 ", "  2 ", "  3 ", "  130 ", "  141 "):
        assert code_line in codes, code_line
    assert "changed nothing" in codes


@pytest.mark.parametrize("command", [("leases",), ("leases", "list"), ("leases", "get")])
async def test_leases_help_shows_revoke_with_its_reason(command):
    code, out, _ = await run_cli(*command, "--help")
    assert code == 0
    assert "leasekeeper revoke [NS] TASK_ID --reason TEXT" in out


# --- the namespace first, or with -n ---------------------------------------------------------


async def test_leases_list_takes_the_namespace_positionally(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    target = ("--target", server.target)
    for where in ((namespace,), ("-n", namespace), ("--namespace", namespace)):
        code, out, err = await run_cli("leases", "list", *where, *target, "--json")
        assert (code, err) == (0, "")
        assert [x["task_id"] for x in json_lines(out)] == ["t"], where


async def test_task_commands_take_the_namespace_positionally(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    target = ("--target", server.target)
    code, out, _ = await run_cli("leases", "get", namespace, "t", *target, "--json")
    assert code == 0 and json_lines(out)[0]["task_id"] == "t"
    code, out, _ = await run_cli("effects", "list", namespace, "t", *target, "--json")
    assert (code, out) == (0, "")
    code, out, _ = await run_cli("revoke", namespace, "t", "--reason", "moved", *target, "--json")
    assert code == 0 and json_lines(out)[0]["revoked"] is True


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (("leases", "list", "a", "b"), "[NAMESPACE]"),
        (("leases", "list", "a", "-n", "b"), "[NAMESPACE]"),
        (("leases", "get", "a", "b", "c"), "[NAMESPACE] TASK_ID"),
        (("leases", "get", "a", "b", "-n", "c"), "[NAMESPACE] TASK_ID"),
        (("revoke", "a", "b", "c", "--reason", "x"), "[NAMESPACE] TASK_ID"),
        (("watch", "a", "b", "c"), "[NAMESPACE [TASK_ID]]"),
        (("watch", "a", "b", "-n", "c"), "[NAMESPACE [TASK_ID]]"),
    ],
)
async def test_too_many_names_are_a_usage_error_exit_2(args, usage):
    code, out, err = await run_cli(*args, "--target", "127.0.0.1:1")
    assert (code, out) == (2, "")
    assert usage in err and err.count("\n") == 1 and "Traceback" not in err


async def test_watch_takes_a_namespace_then_a_task(server, stub, namespace):
    await claim_held(stub, namespace, "t", owner="a")
    target = ("--target", server.target, "--timeout", "0.5")
    # NS TASK and TASK -n NS: the task's SNAPSHOT first.
    for where in ((namespace, "t"), ("t", "-n", namespace)):
        async with _watching(*where, *target) as proc:
            code, out, err = await _finish(proc)
        assert (code, err) == (0, "")
        assert out.split()[1:4] == ["SNAPSHOT", "t", "fence=1"], where
    # NS alone: the namespace's events (no SNAPSHOT). The watch starts in its own
    # process: claim and release new tasks until it has printed one event (bounded).
    async with _watching(namespace, "--target", server.target, "--count", "1") as proc:
        for i in range(50):
            fence = await claim_held(stub, namespace, f"n{i}")
            await stub.Release(
                pb.ReleaseRequest(namespace=namespace, task_id=f"n{i}", owner_id="w", fence=fence)
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.2)
            if proc.returncode is not None:
                break
        code, out, err = await _finish(proc)
    assert (code, err) == (0, "")
    assert out.split()[1] in ("CLAIMED", "RELEASED") and out.split()[2].startswith("n")


# --- --json: JSON Lines everywhere ----------------------------------------------------------


async def test_leases_get_json_is_one_line_with_the_checkpoint(server, stub, namespace):
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30))
    )
    where = (namespace, "t", "--target", server.target)
    code, out, _ = await run_cli("leases", "get", *where, "--json")
    assert code == 0
    (shown,) = json_lines(out)
    assert shown["checkpoint"] is None
    await stub.SaveCheckpoint(
        pb.SaveCheckpointRequest(
            namespace=namespace,
            task_id="t",
            owner_id="a",
            fence=reply.lease.fence,
            checkpoint=pb.Checkpoint(version=4, data=b"x" * 12, content_type="text/plain"),
        )
    )
    code, out, _ = await run_cli("leases", "get", *where, "--json")
    assert code == 0
    (shown,) = json_lines(out)
    checkpoint = shown.pop("checkpoint")
    assert set(checkpoint) == {"version", "size", "content_type", "fence", "write_time"}
    assert (checkpoint["version"], checkpoint["size"], checkpoint["content_type"]) == (
        4,
        12,
        "text/plain",
    )
    assert checkpoint["fence"] == reply.lease.fence and checkpoint["write_time"]
    assert (shown["task_id"], shown["checkpoint_version"]) == ("t", 4)
    # The table shows the same details.
    code, out, _ = await run_cli("leases", "get", *where)
    version, size, kind, by, _written = fields(out)["checkpoint"].split(", ")
    assert (version, size, kind, by) == ("version 4", "12 bytes", "text/plain", "fence 1")


async def test_every_server_command_prints_json_lines(server, stub, namespace):
    # A task whose every listing has rows: an effect, a history, a quarantine to retry.
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30), max_attempts=1)
    )
    await stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace,
            task_id="t",
            fence=reply.lease.fence,
            effect_key="e",
            policy=pb.EFFECT_POLICY_ONCE,
        )
    )
    await claim_held(stub, namespace, "other")
    target = ("--target", server.target, "--json")
    commands = [
        ("leases", "list", namespace),
        ("leases", "get", namespace, "t"),
        ("effects", "list", namespace, "t"),
        ("tasks", "history", namespace, "t"),
        ("revoke", namespace, "t", "--reason", "stuck"),  # its last attempt: QUARANTINED
        ("tasks", "retry", namespace, "t", "--reason", "fixed"),
        ("tasks", "cancel", namespace, "t", "--reason", "done"),
        ("namespaces", "--limit", "3"),
        ("watch", namespace, "other", "--count", "1"),
    ]
    shapes = {}
    for command in commands:
        code, out, _ = await run_cli(*command, *target)
        assert code == 0, command
        shapes[command[:2]] = json_lines(out)
    assert {"revoked", "lease"} == set(shapes[("revoke", namespace)][0])
    assert {"cancelled", "lease"} == set(shapes[("tasks", "cancel")][0])
    assert {"lease"} == set(shapes[("tasks", "retry")][0])
    assert {"namespace", "task_count", "task_count_capped"} == set(
        shapes[("namespaces", "--limit")][0]
    )
    assert {"type", "lease", "event_time"} == set(shapes[("watch", namespace)][0])


async def test_every_database_command_prints_json_lines(database_url, namespace):
    env = {"LEASEKEEPER_DATABASE_URL": database_url}
    code, out, _ = await run_cli("migrate", "--json", env=env)
    assert code == 0 and json_lines(out) == [{"applied": []}]
    code, out, _ = await run_cli(
        "tokens",
        "create",
        "--name",
        "n",
        "--role",
        "admin",
        "--namespace",
        namespace,
        "--json",
        env=env,
    )
    assert code == 0
    token_id = json_lines(out)[0]["token_id"]
    for command in (
        ("tokens", "list"),
        ("tokens", "revoke", token_id),
        ("limits", "set", namespace, "--max-leases", "3"),
        ("limits", "list"),
        ("limits", "clear", namespace, "--all"),
    ):
        code, out, _ = await run_cli(*command, "--json", env=env)
        assert code == 0, command
        json_lines(out)


# --- changed nothing: exit 3, said on stderr ------------------------------------------------


async def test_revoke_of_a_free_task_changes_nothing_exit_3(server, stub, namespace):
    fence = await claim_held(stub, namespace, "t", owner="a")
    await stub.Release(
        pb.ReleaseRequest(namespace=namespace, task_id="t", owner_id="a", fence=fence)
    )
    code, out, err = await run_cli(
        "revoke", namespace, "t", "--reason", "x", "--target", server.target
    )
    assert code == UNCHANGED
    assert err == (
        "leasekeeper: nothing changed: t holds no lease to revoke (state FREE, current fence 1)\n"
    )
    shown = fields(out)
    assert (shown["state"], shown["revoke_reason"]) == ("FREE", "-")


async def test_limits_set_of_the_values_set_changes_nothing_exit_3(database_url, db, namespace):
    env = {"LEASEKEEPER_DATABASE_URL": database_url}
    given = ("--max-leases", "5", "--lock-delay", "2")
    code, _, _ = await run_cli("limits", "set", namespace, *given, env=env)
    assert code == 0
    before = await db.fetchrow(
        "SELECT * FROM leasekeeper_namespace_limits WHERE namespace = $1", namespace
    )
    code, out, err = await run_cli("limits", "set", namespace, *given, "--json", env=env)
    assert code == UNCHANGED
    assert err == f'leasekeeper: nothing changed: the limits of "{namespace}" have these values\n'
    (shown,) = json_lines(out)
    assert (shown["max_leases"], shown["lock_delay"]) == (5, 2.0)
    after = await db.fetchrow(
        "SELECT * FROM leasekeeper_namespace_limits WHERE namespace = $1", namespace
    )
    assert after == before  # not written: update_time too
    # Part of the values set, one of them new: a change.
    code, _, _ = await run_cli("limits", "set", namespace, "--max-leases", "6", env=env)
    assert code == 0


async def test_limits_clear_of_limits_not_set_changes_nothing_exit_3(database_url, db, namespace):
    env = {"LEASEKEEPER_DATABASE_URL": database_url}
    code, out, err = await run_cli("limits", "clear", namespace, "--all", env=env)
    assert (code, out) == (UNCHANGED, f"{namespace}: no limits\n")
    assert err == f'leasekeeper: nothing changed: "{namespace}" has none of these limits set\n'
    assert (await run_cli("limits", "set", namespace, "--max-leases", "2", env=env))[0] == 0
    code, out, _ = await run_cli("limits", "clear", namespace, "--lock-delay", env=env)
    assert code == UNCHANGED
    assert fields(out)["max_leases"] == "2"
    code, _, _ = await run_cli("limits", "clear", namespace, "--max-leases", env=env)
    assert code == 0  # the last limit: the row is removed
    assert (
        await db.fetchval(
            "SELECT count(*) FROM leasekeeper_namespace_limits WHERE namespace = $1", namespace
        )
        == 0
    )


# --- an empty namespace names the namespaces with tasks; `namespaces` -----------------------


async def test_leases_list_of_an_empty_namespace_names_those_with_tasks(server, stub, namespace):
    # "!" sorts before the other tests' namespaces ("test-..."): these come first.
    billing, reports = f"!{namespace}-billing", f"!{namespace}-reports"
    for task_id in ("a", "b", "c"):
        await claim_held(stub, billing, task_id)
    await claim_held(stub, reports, "r")
    target = ("--target", server.target)
    code, out, err = await run_cli("leases", "list", namespace, *target)
    assert code == 0
    assert out.split() == table_rows(out)[0]  # the header alone
    assert err.startswith(
        f'leasekeeper: namespace "{namespace}" holds no tasks; namespaces with tasks: '
    )
    assert err.count("\n") == 1
    # The hint names the first namespaces by name, with their task counts.
    assert err.split(": ", 2)[2].startswith(f"{billing} (3), {reports} (1)")
    # --json: nothing on stdout, the same hint on stderr.
    code, out, json_err = await run_cli("leases", "list", namespace, *target, "--json")
    assert (code, out, json_err) == (0, "", err)
    # A filter that matches nothing says nothing about the namespace.
    code, _, err = await run_cli("leases", "list", billing, "--state", "EXPIRED", *target)
    assert (code, err) == (0, "")


async def test_namespaces_lists_namespaces_with_their_task_counts(server, stub, namespace):
    for task_id in ("a", "b"):
        await claim_held(stub, f"{namespace}/x", task_id)
    target = ("--target", server.target)
    code, out, err = await run_cli("namespaces", *target)
    assert (code, err) == (0, "")
    header, rows = table_rows(out)
    assert header == ["NAMESPACE", "TASKS"]
    assert [f"{namespace}/x", "2"] in rows
    assert_aligned(out)
    code, out, _ = await run_cli("namespaces", *target, "--json", "--page-size", "2")
    listed = json_lines(out)
    assert {
        "namespace": f"{namespace}/x",
        "task_count": 2,
        "task_count_capped": False,
    } in listed
    names = [x["namespace"] for x in listed]
    assert names == sorted(names, key=lambda name: name.encode("utf-8"))
    code, out, _ = await run_cli("namespaces", *target, "--json", "--limit", "1")
    assert code == 0 and len(json_lines(out)) == 1


# --- watch: an event's own reason -----------------------------------------------------------


async def test_watch_retried_event_shows_no_earlier_revoke_reason(server, stub, namespace):
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30), max_attempts=1)
    )
    assert reply.acquired
    where = (namespace, "t", "--target", server.target)
    code, _, _ = await run_cli("revoke", *where, "--reason", "stuck worker")
    assert code == 0  # its only attempt: QUARANTINED, revoke_reason "stuck worker"
    async with _watching(*where, "--count", "2") as proc:
        assert "SNAPSHOT" in await _line(proc)
        code, _, _ = await run_cli("tasks", "retry", *where, "--reason", "input fixed")
        assert code == 0
        code, out, err = await _finish(proc)
    assert (code, err) == (0, "")
    retried = out.split()
    assert retried[1:6] == ["RETRIED", "t", "fence=1", "owner=a", "state=FREE"]
    assert "stuck" not in out and "reason=" not in out
    # The REVOKED event itself shows its reason.
    await claim_held(stub, namespace, "t", owner="b")
    async with _watching(*where, "--count", "2") as proc:
        assert "SNAPSHOT" in await _line(proc)
        code, _, _ = await run_cli("revoke", *where, "--reason", "second stop")
        assert code == 0
        code, out, _ = await _finish(proc)
    assert out.split()[1] == "REVOKED" and out.rstrip().endswith('reason="second stop"')

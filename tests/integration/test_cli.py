"""The `leasekeeper` command against a real server and database.

The operator commands `leases list|get` and `effects list`; how the commands
that open the database (`migrate`, `tokens`, `limits`) report a database they
cannot use; `--version`; and the container probe
`python -m leasekeeper_server.cli.healthcheck`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import sys

import pytest

from leasekeeper.ids import BIDI_CONTROLS
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.rpc.service import SERVICE_NAME
from tests.conftest import running_server
from tests.fault.dburl import database_address, proxied, replaced
from tests.fault.processes import NOT_SERVING, QUICK_OUTAGE_SETTINGS, health_status
from tests.fault.proxy import tcp_proxy
from tests.helpers import claim_held, poll
from tests.integration.contract_helpers import backdate

CLI_TIMEOUT_S = 30.0


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Runs `python -m leasekeeper_server.cli.main ARGS`; returns (code, stdout, stderr).

    ``env`` adds to (and overrides) this process's environment; the target
    and token variables of the caller's shell are not inherited.
    """
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("LEASEKEEPER_TARGET", "LEASEKEEPER_TOKEN")
    }
    full_env.update(env or {})
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "leasekeeper_server.cli.main",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full_env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def table_rows(text: str) -> tuple[list[str], list[list[str]]]:
    """A table's header names and its rows' cells (cells hold no spaces in these tests)."""
    lines = text.splitlines()
    return lines[0].split(), [line.split() for line in lines[1:]]


def assert_aligned(text: str) -> None:
    """Every line of a printed table has its column gaps where the header has them.

    Columns are as wide as their widest cell and the header is padded to
    them, so the two-space gap before each header name must be blank on
    every line; and every line has one cell per column (cells in these tests
    hold no spaces).
    """
    lines = text.splitlines()
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and i > 0 and header[i - 1] == " "]
    for line in lines[1:]:
        assert len(line.split()) == len(header.split()), f"{line!r} under {header!r}"
        for start in starts:
            assert line[start - 2 : start] == "  ", f"misaligned: {line!r} under {header!r}"


async def test_leases_get_held_task_prints_its_lease(server, stub, namespace):
    await claim_held(stub, namespace, "t1")
    where = ("-n", namespace, "--target", server.target)
    code, out, _ = await run_cli("leases", "get", "t1", *where, "--json")
    assert code == 0
    shown = json.loads(out)
    assert (shown["task_id"], shown["owner_id"], shown["fence"], shown["state"]) == (
        "t1",
        "w",
        1,
        "HELD",
    )
    assert shown["revoke_reason"] == "" and shown["end_reason"] is None

    code, out, _ = await run_cli("leases", "get", "t1", *where)
    assert code == 0
    fields = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert (fields["task_id"], fields["owner_id"], fields["fence"], fields["state"]) == (
        "t1",
        "w",
        "1",
        "HELD",
    )
    assert fields["expire_time"].endswith("Z") and fields["remaining_ttl"].endswith("s")
    assert fields["end_reason"] == "-"


async def test_leases_get_unknown_task_exits_1(server, namespace):
    code, out, err = await run_cli(
        "leases", "get", "nope", "-n", namespace, "--target", server.target
    )
    assert code == 1
    assert out == ""
    assert err.startswith("leasekeeper: NOT_FOUND:") and err.count("\n") == 1


async def test_leases_list_state_filter_lists_only_that_state(server, stub, namespace):
    for task_id in ("a", "b", "c"):
        await claim_held(stub, namespace, task_id)
    await stub.Release(pb.ReleaseRequest(namespace=namespace, task_id="b", owner_id="w", fence=1))
    where = ("-n", namespace, "--target", server.target)
    code, out, _ = await run_cli("leases", "list", *where, "--state", "HELD", "--json")
    assert code == 0
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(x["task_id"], x["state"]) for x in listed] == [("a", "HELD"), ("c", "HELD")]

    code, out, _ = await run_cli("leases", "list", *where, "--state", "HELD")
    assert code == 0
    header, rows = table_rows(out)
    assert header[:4] == ["TASK_ID", "STATE", "FENCE", "OWNER_ID"]
    assert [row[:4] for row in rows] == [["a", "HELD", "1", "w"], ["c", "HELD", "1", "w"]]
    assert_aligned(out)


async def test_leases_list_default_prints_an_aligned_table_of_every_task(server, stub, namespace):
    await claim_held(stub, namespace, "short", owner="worker-with-a-long-name")
    await claim_held(stub, namespace, "a-much-longer-task-id", owner="w")
    await stub.Release(
        pb.ReleaseRequest(
            namespace=namespace, task_id="short", owner_id="worker-with-a-long-name", fence=1
        )
    )
    code, out, _ = await run_cli("leases", "list", "-n", namespace, "--target", server.target)
    assert code == 0
    header, rows = table_rows(out)
    assert header == [
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
    by_task = {row[0]: row for row in rows}
    assert by_task["short"][1:4] == ["FREE", "1", "worker-with-a-long-name"]
    assert by_task["short"][-1] == "LEASE_RELEASED"
    assert by_task["a-much-longer-task-id"][-1] == "-"
    assert by_task["a-much-longer-task-id"][4].endswith("s")
    assert_aligned(out)


async def test_leases_list_expired_lists_only_expired_leases(server, stub, db, namespace):
    await claim_held(stub, namespace, "gone", ttl=60)
    await claim_held(stub, namespace, "live", ttl=60)
    await backdate(db, namespace, "gone")  # expired now, on the database clock
    where = ("-n", namespace, "--target", server.target)
    code, out, _ = await run_cli("leases", "list", *where, "--expired", "--json")
    assert code == 0
    assert [(x["task_id"], x["state"]) for x in map(json.loads, out.splitlines())] == [
        ("gone", "EXPIRED")
    ]
    code, out, _ = await run_cli("leases", "list", *where, "--expired")
    assert code == 0
    _, rows = table_rows(out)
    assert [row[:2] for row in rows] == [["gone", "EXPIRED"]]


async def store_held(db, namespace: str, task_id: str, owner_id: str) -> None:
    """A HELD lease written straight into the table, as an id stored before the id rule was."""
    await db.execute(
        "INSERT INTO leasekeeper_tasks (namespace, task_id, owner_id, fence, state, expire_time,"
        " runtime_deadline, claim_time, update_time)"
        " SELECT $1, $2, $3, 1, 'held', now + interval '60 s', now + interval '1 hour', now, now"
        " FROM clock_timestamp() now",
        namespace,
        task_id,
        owner_id,
    )


async def test_leases_list_table_shows_bidi_controls_escaped_and_blank_ids_quoted(
    server, db, namespace
):
    # Shown raw, U+202E would print "task-\u202e21" as "task-12" and reorder the row after it.
    await store_held(db, namespace, "task-\u202e21", "\u2066w\u2069")
    await store_held(db, namespace, "   ", "w")
    await store_held(db, namespace, "pad ", "w")
    # Stored before the id rule asked for a visible character and refused U+2028.
    await store_held(db, namespace, "v\u200b", "\u3164")
    await store_held(db, namespace, "w\u2028x", " \u200b ")
    where = ("-n", namespace, "--target", server.target)
    code, out, _ = await run_cli("leases", "list", *where)
    assert code == 0
    assert not (BIDI_CONTROLS | {"\u2028", "\u3164"}) & set(out)
    header, *lines = out.splitlines()
    state_at, owner_at = header.index("STATE"), header.index("OWNER_ID")
    # Cells are cut at the header's columns: a quoted cell may hold spaces.
    shown = [(line[:state_at].rstrip(), line[owner_at:].split()[0]) for line in lines]
    assert shown == [
        ('"   "', "w"),
        ('"pad "', "w"),
        ("task-\\u202e21", "\\u2066w\\u2069"),
        ("v\u200b", '"\\u3164"'),  # visible: shown as stored
        ("w\\u2028x", '"'),  # a quoted owner " \u200b " holds spaces: cut at the first
    ]
    assert '" \\u200b "' in lines[-1]

    code, out, _ = await run_cli("leases", "list", *where, "--json")
    assert code == 0
    # One object per "\n"-ended line; str.splitlines would also split at U+2028.
    listed = [json.loads(line) for line in out.split("\n") if line]
    assert [(x["task_id"], x["owner_id"]) for x in listed] == [
        ("   ", "w"),
        ("pad ", "w"),
        ("task-\u202e21", "\u2066w\u2069"),
        ("v\u200b", "\u3164"),
        ("w\u2028x", " \u200b "),
    ]
    assert "\u202e" in out  # exact, not escaped: JSON is read by programs


async def test_leases_list_owner_filters_across_pages(server, stub, namespace):
    for i in range(7):
        await claim_held(stub, namespace, f"t{i}", owner="mine" if i % 3 == 0 else "other")
    where = ("-n", namespace, "--target", server.target)
    # Pages of 2 tasks: the owner's tasks are spread over four pages.
    code, out, _ = await run_cli(
        "leases", "list", *where, "--owner", "mine", "--page-size", "2", "--json"
    )
    assert code == 0
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(x["task_id"], x["owner_id"]) for x in listed] == [
        ("t0", "mine"),
        ("t3", "mine"),
        ("t6", "mine"),
    ]
    code, out, _ = await run_cli("leases", "list", *where, "--owner", "mine", "--limit", "2")
    assert code == 0
    _, rows = table_rows(out)
    assert [row[0] for row in rows] == ["t0", "t3"]
    code, out, _ = await run_cli("leases", "list", *where, "--owner", "nobody")
    assert code == 0
    assert out.splitlines()[0].split()[0] == "TASK_ID" and len(out.splitlines()) == 1


async def test_leases_list_limit_stops_after_n_tasks(server, stub, namespace):
    for task_id in ("a", "b", "c", "d"):
        await claim_held(stub, namespace, task_id)
    code, out, _ = await run_cli(
        "leases", "list", "-n", namespace, "--target", server.target, "--limit", "3", "--json"
    )
    assert code == 0
    assert [json.loads(line)["task_id"] for line in out.splitlines()] == ["a", "b", "c"]


async def test_leases_list_state_and_expired_together_is_a_usage_error(server, namespace):
    code, _, err = await run_cli(
        "leases", "list", "-n", namespace, "--state", "HELD", "--expired", "--target", server.target
    )
    assert code == 2
    assert "--expired" in err


async def test_leases_get_bad_namespace_prints_one_line_exits_1(server):
    code, _, err = await run_cli("leases", "get", "t", "-n", "", "--target", server.target)
    assert code == 1
    assert err.startswith("leasekeeper: INVALID_ARGUMENT:") and "namespace" in err
    assert err.count("\n") == 1 and "Traceback" not in err


async def test_leases_list_unreachable_server_prints_one_line_exits_1(unused_tcp_port):
    target = f"127.0.0.1:{unused_tcp_port}"
    code, _, err = await run_cli("leases", "list", "-n", "ns", "--target", target)
    assert code == 1
    assert err.startswith("leasekeeper: UNAVAILABLE:")
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("form", [(), ("--json",)], ids=["table", "json"])
async def test_leases_list_into_a_closed_pipe_exits_141_without_a_traceback(
    server, stub, namespace, form
):
    """`leasekeeper leases list | head -1`: the reader may go before the first line.

    The command ends as a tool killed by SIGPIPE would (128 + 13), with nothing on stderr.
    """
    await claim_held(stub, namespace, "t")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    env = {
        k: v for k, v in os.environ.items() if k not in ("LEASEKEEPER_TARGET", "LEASEKEEPER_TOKEN")
    }
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "leasekeeper_server.cli.main",
            "leases",
            "list",
            "-n",
            namespace,
            "--target",
            server.target,
            *form,
            stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    finally:
        os.close(write_end)
    _, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    assert (proc.returncode, err.decode()) == (141, "")


async def test_leases_list_target_comes_from_the_environment(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    code, out, _ = await run_cli(
        "leases", "list", "-n", namespace, "--json", env={"LEASEKEEPER_TARGET": server.target}
    )
    assert code == 0
    assert [json.loads(line)["task_id"] for line in out.splitlines()] == ["t"]


async def test_effects_list_shows_what_was_reserved_by_which_fence(server, stub, namespace):
    await claim_held(stub, namespace, "t")
    for key in ("email", "draft"):
        await stub.BeginEffect(
            pb.BeginEffectRequest(
                namespace=namespace,
                task_id="t",
                fence=1,
                effect_key=key,
                policy=pb.EFFECT_POLICY_ONCE,
                request_digest=b"\x01\xff",
            )
        )
    await stub.CompleteEffect(
        pb.CompleteEffectRequest(
            namespace=namespace,
            task_id="t",
            fence=1,
            effect_key="email",
            outcome=pb.EFFECT_STATE_SUCCEEDED,
            result=b"msg-7",
        )
    )
    where = ("-n", namespace, "--target", server.target)
    code, out, _ = await run_cli("effects", "list", "t", *where, "--json")
    assert code == 0
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(x["effect_key"], x["state"], x["fence"]) for x in listed] == [
        ("draft", "RESERVED", 1),
        ("email", "SUCCEEDED", 1),
    ]
    assert (listed[1]["result"], listed[1]["request_digest"]) == ("msg-7", "01ff")
    assert listed[1]["complete_fence"] == 1 and listed[0]["complete_time"] is None
    code, out, _ = await run_cli("effects", "list", "t", *where, "--state", "RESERVED", "--json")
    assert [json.loads(line)["effect_key"] for line in out.splitlines()] == ["draft"]

    code, out, _ = await run_cli("effects", "list", "t", *where)
    assert code == 0
    header, rows = table_rows(out)
    assert header[:3] == ["EFFECT_KEY", "POLICY", "STATE"]
    assert [row[:5] for row in rows] == [
        ["draft", "ONCE", "RESERVED", "1", "0"],
        ["email", "ONCE", "SUCCEEDED", "1", "1"],
    ]
    assert rows[1][-1] == "msg-7" and rows[0][-1] == "-"
    assert_aligned(out)


# The commands that open the database themselves, as `migrate` does.
DATABASE_COMMANDS = [("migrate",), ("tokens", "list"), ("limits", "list")]


def assert_one_line(err: str, *names: str) -> None:
    """``err`` is one line, no traceback, naming each of ``names``."""
    assert "Traceback" not in err, err
    assert err.startswith("leasekeeper: ") and err.count("\n") == 1, err
    for name in names:
        assert name in err, err


@pytest.mark.parametrize("command", DATABASE_COMMANDS, ids=" ".join)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"role": "nosuchrole"}, 'role "nosuchrole" does not exist'),
        ({"database": "nosuchdatabase"}, 'database "nosuchdatabase" does not exist'),
    ],
    ids=["role", "database"],
)
async def test_database_command_refused_by_the_database_exits_2_with_its_message(
    database_url, command, change, message
):
    env = {"LEASEKEEPER_DATABASE_URL": replaced(database_url, **change)}
    code, out, err = await run_cli(*command, env=env)
    assert (code, out) == (2, "")
    assert_one_line(err, "LEASEKEEPER_DATABASE_URL", message)


@pytest.mark.parametrize("command", DATABASE_COMMANDS, ids=" ".join)
async def test_database_command_with_a_malformed_url_exits_2(command):
    code, out, err = await run_cli(*command, env={"LEASEKEEPER_DATABASE_URL": "mysql://x"})
    assert (code, out) == (2, "")
    assert_one_line(err, "LEASEKEEPER_DATABASE_URL", "mysql")


@pytest.mark.parametrize("command", DATABASE_COMMANDS, ids=" ".join)
@pytest.mark.parametrize(
    ("parameter", "message"),
    [
        ("foo=bar", 'unrecognized configuration parameter "foo"'),
        ("work_mem=abc", 'invalid value for parameter "work_mem": "abc"'),
    ],
    ids=["unknown", "bad-value"],
)
async def test_database_command_with_a_url_parameter_postgres_refuses_exits_2(
    database_url, command, parameter, message
):
    # asyncpg sends a URL's unknown query parameters to PostgreSQL as settings
    # (work_mem: one the commands' own session settings do not replace).
    separator = "&" if "?" in database_url else "?"
    env = {"LEASEKEEPER_DATABASE_URL": f"{database_url}{separator}{parameter}"}
    code, out, err = await run_cli(*command, env=env)
    assert (code, out) == (2, "")
    assert_one_line(err, "LEASEKEEPER_DATABASE_URL", message)


async def test_migrate_database_out_of_reach_prints_one_line_exits_1(unused_tcp_port):
    url = f"postgresql://postgres@127.0.0.1:{unused_tcp_port}/postgres"
    code, out, err = await run_cli("migrate", env={"LEASEKEEPER_DATABASE_URL": url})
    assert (code, out) == (1, "")
    assert_one_line(err, "database unavailable")


async def test_version_prints_the_installed_package_version():
    code, out, _ = await run_cli("--version")
    assert (code, out) == (0, f"leasekeeper {importlib.metadata.version('leasekeeper')}\n")


async def run_healthcheck(target: str) -> tuple[int, str, str]:
    """Runs the healthcheck module on TARGET; returns (code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "leasekeeper_server.cli.healthcheck",
        target,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_healthcheck_of_a_serving_server_prints_serving_exits_0(server):
    assert await run_healthcheck(server.target) == (0, f"{server.target}: SERVING\n", "")


async def test_healthcheck_of_a_server_without_its_database_prints_not_serving_exits_1(
    database_url,
):
    async with tcp_proxy(*database_address(database_url)) as proxy:
        url = proxied(database_url, proxy.port)
        async with running_server(url, **QUICK_OUTAGE_SETTINGS) as running:
            proxy.cut()

            async def not_serving() -> bool:
                return await health_status(running.target, 1.0, SERVICE_NAME) == NOT_SERVING

            await poll(not_serving, "health NOT_SERVING once the database is cut")
            result = await run_healthcheck(running.target)
    assert result == (1, f"{running.target}: NOT_SERVING\n", "")


async def test_healthcheck_of_nothing_listening_says_why_exits_1(unused_tcp_port):
    target = f"127.0.0.1:{unused_tcp_port}"
    code, out, err = await run_healthcheck(target)
    assert (code, out) == (1, "")
    assert err.startswith(f"{target}: cannot ask: UNAVAILABLE") and err.count("\n") == 1, err

"""The `leasekeeper` command's names and lines, without a server.

How ``[NAMESPACE] TASK_ID`` (and ``-n``) resolve for every server command, and
which reason a ``watch`` line shows for each event.
"""

from __future__ import annotations

import pytest

from leasekeeper_server.cli import output as out
from leasekeeper_server.cli import remote
from leasekeeper_server.cli.main import build_parser


def resolved(*argv: str) -> tuple[str, str | None]:
    """(namespace, task_id) of a command line, as the command would call the server."""
    args = build_parser().parse_args(argv)
    remote._resolve(args)
    return args.namespace, args.task_id


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("leases", "list"), ("default", None)),
        (("leases", "list", "billing"), ("billing", None)),
        (("leases", "list", "-n", "billing"), ("billing", None)),
        (("leases", "get", "t"), ("default", "t")),
        (("leases", "get", "billing", "t"), ("billing", "t")),
        (("leases", "get", "t", "-n", "billing"), ("billing", "t")),
        (("effects", "list", "billing", "t"), ("billing", "t")),
        (("tasks", "history", "billing", "t"), ("billing", "t")),
        (("tasks", "cancel", "t", "--reason", "r"), ("default", "t")),
        (("tasks", "retry", "billing", "t", "--reason", "r"), ("billing", "t")),
        (("revoke", "billing", "t", "--reason", "r"), ("billing", "t")),
        (("revoke", "t", "--namespace", "billing", "--reason", "r"), ("billing", "t")),
        (("watch",), ("default", None)),
        (("watch", "billing"), ("billing", None)),
        (("watch", "billing", "t"), ("billing", "t")),
        (("watch", "t", "-n", "billing"), ("billing", "t")),
        (("watch", "-n", "billing"), ("billing", None)),
    ],
)
def test_names_resolve_to_a_namespace_and_a_task(argv, expected):
    assert resolved(*argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ("leases", "list", "a", "b"),
        ("leases", "list", "a", "-n", "b"),
        ("leases", "get", "a", "b", "c"),
        ("leases", "get", "a", "b", "-n", "c"),
        ("revoke", "a", "b", "c", "--reason", "r"),
        ("tasks", "history", "a", "b", "c"),
        ("watch", "a", "b", "c"),
        ("watch", "a", "b", "-n", "c"),
    ],
)
def test_too_many_names_are_refused(argv):
    with pytest.raises(remote.UsageError, match="takes"):
        resolved(*argv)


def event(kind: str, state: str, **reasons: str) -> out.Record:
    lease = {"task_id": "t", "fence": 1, "owner_id": "a", "state": state, **reasons}
    return {"type": kind, "lease": lease, "event_time": None}


LEFT_OVER = {"revoke_reason": "stuck worker"}  # a lease's revoke reason outlives its revoke


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (event("REVOKED", "FREE", revoke_reason="stuck worker"), 'reason="stuck worker"'),
        (event("CANCELLED", "CANCELLED", cancel_reason="stop", **LEFT_OVER), "reason=stop"),
        (event("FAILED", "FAILED", fail_reason="oom", **LEFT_OVER), "reason=oom"),
        (event("RETRIED", "FREE", **LEFT_OVER), None),
        (event("CLAIMED", "HELD", **LEFT_OVER), None),
        (event("EXPIRED", "EXPIRED", **LEFT_OVER), None),
        (event("QUARANTINED", "QUARANTINED", **LEFT_OVER), None),
        (event("SNAPSHOT", "FREE", **LEFT_OVER), None),
        (event("SNAPSHOT", "CANCELLED", cancel_reason="stop", **LEFT_OVER), "reason=stop"),
    ],
)
def test_a_watch_line_shows_the_events_own_reason(record, reason):
    line = remote._watch_line(record)
    shown = [part for part in line.split("  ") if part.startswith("reason=")]
    assert shown == ([reason] if reason else [])


def test_every_exit_code_is_in_the_help():
    parser = build_parser()
    epilog = parser.epilog or ""
    for code in (out.EXIT_OK, out.EXIT_FAILED, out.EXIT_USAGE, out.EXIT_UNCHANGED, 130, 141):
        assert f"\n  {code} " in epilog, code

"""No clock but PostgreSQL's decides a lease: server and worker clocks an hour off change nothing.

The same scripted scenario (``clock_scenario.py``: claim with a 1 s ttl,
renew, validate, a heartbeat left to expire, expiry, a second owner's claim
with fence 2, the old fence invalid, release, completion) runs three times,
each against a fresh ``leasekeeper serve`` process:

* server under libfaketime at ``+1h``, worker at ``-1h``;
* server at ``-1h``, worker at ``+1h``;
* both on the real clock.

All three must record the same outcomes. Only the wall clock is shifted
(``FAKETIME_DONT_FAKE_MONOTONIC``): a monotonic clock's origin is arbitrary,
so its offset decides nothing. libfaketime comes from the ``libfaketime``
package, a test dependency, so this runs on every machine that runs the tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.fault.processes import faketime_env, run_python, server_env, server_process

pytestmark = [pytest.mark.timeout(60), pytest.mark.process]

SCENARIO = Path(__file__).with_name("clock_scenario.py")
OFFSETS_S = {None: 0, "+1h": 3600, "-1h": -3600}
RUNS = [("+1h", "-1h"), ("-1h", "+1h"), (None, None)]  # (server, worker)
CLOCK_TOLERANCE_S = 120
SETTINGS = {"min_ttl_s": 0.1, "min_renew_interval_s": 0.2, "health_interval_s": 0.2}
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ ", re.MULTILINE)

# What the scenario must record, whatever the clocks of server and worker say.
EXPECTED: list[Any] = [
    ["claim", "a", True, 1, "TASK_STATE_HELD", 1],
    ["claim", "b", False, 1],
    ["claim", "a", True, 1, "TASK_STATE_HELD", 1],
    ["renew", "a", 1, 1, 1],
    ["validate", 1, True, 1, "LOSS_REASON_UNSPECIFIED", 1],
    ["beat", 1, True, 2],
    ["beat", 1, True, 2],
    ["heartbeat_end", {"code": "ABORTED", "reason": "LEASE_EXPIRED"}],
    ["validate", 1, False, 1, "LOSS_REASON_LEASE_EXPIRED", 0],
    ["renew", "a", 1, {"code": "ABORTED", "reason": "LEASE_EXPIRED"}],
    ["claim", "b", True, 2, "TASK_STATE_HELD", 1],
    ["validate", 1, False, 2, "LOSS_REASON_LEASE_SUPERSEDED", 0],
    ["validate", 2, True, 2, "LOSS_REASON_UNSPECIFIED", 1],
    ["renew", "a", 1, {"code": "ABORTED", "reason": "LEASE_SUPERSEDED"}],
    ["release", "b", 2, 2, "TASK_STATE_FREE"],
    ["validate", 2, False, 2, "LOSS_REASON_LEASE_RELEASED", 0],
    ["validate", 3, False, 2, "LOSS_REASON_FENCE_UNKNOWN", 0],
    ["claim", "a", True, 3, "TASK_STATE_HELD", 1],
    ["release", "a", 3, 3, "TASK_STATE_COMPLETED"],
    ["claim", "b", {"code": "FAILED_PRECONDITION", "reason": "TASK_COMPLETED"}],
]


def assert_offset(label: str, seen_s: float, offset: str | None) -> None:
    """The process's wall clock really is shifted by ``offset`` (libfaketime applies)."""
    wanted = OFFSETS_S[offset]
    assert abs(seen_s - wanted) < CLOCK_TOLERANCE_S, (
        f"{label} clock is off by {seen_s:+.0f} s, expected {wanted:+d} s: "
        "is libfaketime preloaded?"
    )


async def run_once(
    tmp_path: Path,
    database_url: str,
    namespace: str,
    server_offset: str | None,
    worker_offset: str | None,
) -> list[Any]:
    label = f"server{server_offset or '0'}-worker{worker_offset or '0'}"
    env = server_env(database_url, **SETTINGS) | faketime_env(server_offset)
    async with server_process(tmp_path / label, env) as server:
        first_log = _LOG_TIME.search(server.logs())
        assert first_log, server.logs()
        logged = datetime.strptime(first_log.group(1), "%Y-%m-%d %H:%M:%S")
        assert_offset("server", (logged - datetime.now()).total_seconds(), server_offset)

        worker_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKETIME")}
        worker_env["PYTHONPATH"] = os.pathsep.join(sys.path)
        worker_env |= faketime_env(worker_offset)
        code, out, err = await run_python(
            SCENARIO,
            [server.target, f"{namespace}-{label}"],
            timeout_s=30,
            env=worker_env,
        )
        assert code == 0, f"{label} worker failed ({code}):\n{err}\nserver log:\n{server.logs()}"
        report = json.loads(out)
        # e.g. asyncio's "Task was destroyed but it is pending!" from a leaked waiter
        assert " ERROR " not in server.logs(), f"{label} server logged an error:\n{server.logs()}"
        assert_offset("worker", report["worker_time"] - time.time(), worker_offset)
        return report["outcomes"]


async def test_lease_outcomes_server_and_worker_clocks_shifted_identical(
    tmp_path: Path, database_url: str, namespace: str
) -> None:
    results = await asyncio.gather(
        *(run_once(tmp_path, database_url, namespace, s, w) for s, w in RUNS)
    )
    by_run = {
        f"server {s or 'real'} / worker {w or 'real'}": r
        for (s, w), r in zip(RUNS, results, strict=True)
    }
    for label, outcomes in by_run.items():
        assert outcomes == EXPECTED, f"{label} differs:\n" + json.dumps(outcomes, indent=1)
    assert results[0] == results[1] == results[2]

"""The benchmark's reference points run: each one briefly, through the shared load generator.

No figures are judged here (the machine is shared); only that every reference
answers calls and none fails.
"""

from __future__ import annotations

import pytest

from bench.etcd import INSTALL_HINT, etcd_binary, etcd_claim, etcd_server
from bench.loadgen import Op, closed_loop
from bench.reference import noop_server, raw_claim
from bench.scenarios import SCENARIOS, scenario_op

pytestmark = pytest.mark.process


async def run_briefly(op: Op) -> None:
    """0.3 s at 4 concurrent, every call counted: some calls, no errors."""
    sample = await closed_loop(op, concurrency=4, duration_s=0.3, warmup_s=0.0)
    assert sample.calls > 0
    assert not sample.errors, dict(sample.errors)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_noop_server_answers_every_scenario_the_suite_runs(loop: str) -> None:
    # The same ops the suite measures it with (unary calls through the real
    # client, and the Heartbeat echo), so a reference that stopped answering
    # one of them fails here rather than in a benchmark run.
    async with noop_server(loop) as target:
        assert target.pid > 0
        for scenario in SCENARIOS:
            async with scenario_op(scenario, target.address, "bench", 4, f"t-{loop}") as op:
                await run_briefly(op)


async def test_raw_asyncpg_runs_the_servers_claim(database_url: str, namespace: str) -> None:
    async with raw_claim(database_url, namespace) as op:
        await run_briefly(op)


async def test_etcd_claims_distinct_and_hot_keys() -> None:
    assert etcd_binary() is not None, f"etcd is not installed: {INSTALL_HINT}"
    async with etcd_server(install=False) as target:
        async with etcd_claim(target) as op:
            await run_briefly(op)
        async with etcd_claim(target, hot=True) as op:
            await run_briefly(op)

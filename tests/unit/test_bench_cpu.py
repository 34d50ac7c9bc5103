"""The bench's CPU accounting: a process's CPU read by its command name, and the budget table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.procstat import command_cpu_seconds
from bench.report import cpu_budget

BURN_S = 0.3


def test_command_cpu_seconds_counts_a_live_process_by_its_command_name(tmp_path: Path) -> None:
    # The kernel names a process after the file it executed: a link with a
    # name of its own gives the probe a command name nothing else has.
    probe = tmp_path / "lkcpuprobe"
    probe.symlink_to(sys.executable)
    burn = (
        "import sys, time\n"
        f"end = time.process_time() + {BURN_S}\n"
        "while time.process_time() < end: pass\n"
        "print('burnt', flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [str(probe), "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline() == "burnt\n"
            used = command_cpu_seconds("lkcpuprobe")
        finally:
            child.stdin.close()  # the child reads its end of input and leaves
            child.wait(10)
    assert BURN_S * 0.9 <= used < BURN_S + 2.0  # interpreter start-up adds a little
    assert command_cpu_seconds("lkcpuprobe") == 0.0  # gone: nothing is left to count


def _point(target: str, client: float, server: float, db: float) -> dict[str, object]:
    return {
        "target": target,
        "scenario": "renew",
        "concurrency": 64,
        "rows": None,
        "client_cpu_ms_per_call": client,
        "cpu_ms_per_call": server,
        "db_cpu_ms_per_call": db,
    }


def test_cpu_budget_sums_every_process_and_bounds_the_rate_by_the_cores() -> None:
    points = [_point("leasekeeper", 0.4, 0.6, 0.2), _point("reference", 0.3, 0.5, 0.0)]
    lines = cpu_budget(points, ["renew"], cpus=2)
    row = [cell.strip() for cell in lines[-1].strip("|").split("|")]
    # client, server, PostgreSQL, total, bound; the reference's; the reference's total / ours
    ours = ["0.400", "0.600", "0.200", "1.200", "1,667"]
    reference = ["0.300", "0.500", "0.000", "0.800", "2,500"]
    assert row == ["Renew", *ours, *reference, "0.67"]


def test_cpu_budget_leaves_out_a_run_without_cpu_figures() -> None:
    bare = _point("leasekeeper", 0.4, 0.6, 0.2)
    bare["db_cpu_ms_per_call"] = None  # an older results.json
    assert cpu_budget([bare, _point("reference", 0.3, 0.5, 0.0)], ["renew"], cpus=2) == []

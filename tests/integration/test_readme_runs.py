"""The README's resumable-run snippet runs as written, and resumes from the stored checkpoint."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from leasekeeper import LeaseClient

README = Path(__file__).resolve().parents[2] / "README.md"


def runs_snippet() -> str:
    """The first python block of the README's "Runs that survive their workers" section."""
    text = README.read_text()
    section = text.split("## Runs that survive their workers", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the section has no python block"
    return match.group(1)


async def run_snippet(target: str) -> str:
    """Runs the snippet in its own process against ``target``; returns its stdout."""
    env = dict(os.environ, LEASEKEEPER_TARGET=target)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        runs_snippet(),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_readme_run_resumes_after_the_stored_checkpoint(server):
    # A predecessor did steps 1 and 2, saved checkpoint 2, and gave the task back.
    async with LeaseClient(server.target, namespace="reports") as client:
        async with client.hold("report-q3", ttl=30.0) as lease:
            await lease.save_checkpoint(2, b'{"step": 2}', "application/json")

    out = await run_snippet(server.target)

    assert re.findall(r"step (\d) \(fence (\d+)\)", out) == [
        ("3", "2"),
        ("4", "2"),
        ("5", "2"),
    ], out
    async with LeaseClient(server.target, namespace="reports") as client:
        info = await client.get_lease("report-q3")
        saved = await client.get_checkpoint("report-q3")
    assert info.state == "COMPLETED"
    assert saved is not None and (saved.version, saved.fence) == (5, 2)

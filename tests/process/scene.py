"""What the process tests share: a scene of real subprocesses (the gateway, workers).

A scene starts the example scripts (``examples/``) as children whose stdout
lines are kept for matching (``demo.Child``) and whose stderr goes to a file
in the test's folder; every child is stopped when the scene closes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from demo import Child

from tests.helpers import poll

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
POLL_INTERVAL_S = 0.02
STEP_TIMEOUT_S = 15.0


class Scene:
    """The gateway and workers of one test, all stopped at the end.

    Args:
        target: The lease service's address.
        namespace: The test's namespace.
        workdir: Where the gateway's SQLite file and the children's stderr go.
    """

    def __init__(self, target: str, namespace: str, workdir: Path) -> None:
        self.target = target
        self.namespace = namespace
        self.workdir = workdir
        self.ledger_path = workdir / "gateway.sqlite3"
        self.gateway_address = ""
        self.gateway: Child | None = None
        self.children: list[Child] = []

    async def spawn(self, label: str, argv: list[str]) -> Child:
        """Start a child; its stderr goes to ``<workdir>/<label>.stderr``."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        child = await Child.start(label, argv, env, self.workdir / f"{label}.stderr")
        self.children.append(child)
        return child

    async def start_gateway(self, *flags: str) -> Child:
        """Start ``examples/gateway.py`` (with ``flags``) and wait until it listens."""
        argv = [sys.executable, str(EXAMPLES_DIR / "gateway.py"), "--leasekeeper", self.target]
        argv += ["--db", str(self.ledger_path), *flags]
        self.gateway = await self.spawn("gateway", argv)
        self.gateway_address = (await self.gateway.wait_for(r"listening on (\S+)")).group(1)
        return self.gateway

    def stderr_of(self, child: Child) -> str:
        """What a child wrote on stderr (shown when an exit code is not the expected one)."""
        return (self.workdir / f"{child.label}.stderr").read_text(errors="replace")

    async def close(self) -> None:
        """Stop every child, the last started first."""
        for child in reversed(self.children):
            await child.stop()


async def poll_until(probe: Callable[[], Awaitable[bool]]) -> None:
    """Await ``probe()`` every 20 ms until it is true; at most a step's timeout (15 s)."""
    async with asyncio.timeout(STEP_TIMEOUT_S):  # also bounds a probe that hangs
        await poll(probe, "a scene's condition", STEP_TIMEOUT_S, POLL_INTERVAL_S)

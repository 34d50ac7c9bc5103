"""The console's pages against a namespace's size: server time per page at 10^5 and 10^6 tasks.

    .venv/bin/python -m bench.run --only console [--console-tasks 100000 1000000]

For each size, a database of its own beside the suite's is seeded by
``scale.seed`` with twice that many task rows (and their history, effects and
checkpoints), so its most populous namespace (``console-0``, half the rows)
holds about that many tasks, and a ``leasekeeper serve`` of its own serves
it with the console on a free loopback port. Then, one request at a time
over HTTP on loopback (httpx), each page kind is requested at each size, in
windows that rotate over the sizes, forwards then backwards, so a drift of
the shared machine weighs on every size alike:

* ``first``: the namespace's first page of tasks (``/namespace?ns=``);
* ``deep``: a page half way through the listing, its page token reached by
  following the ListLeases page token chain from the first page;
* ``state``: the first page of HELD tasks (1 task in 400 at 10^6: the scan
  budget of ListLeases ends the page, short, after 1,000 rows);
* ``owner``: the first page of one owner's tasks (1 in 997);
* ``task``: a held task with a checkpoint and an effect (``/task?ns=&id=``);
* ``namespaces``: the namespaces page (``/``), the five seeded namespaces
  with their figures;

and, to show where a tasks page's time goes, the two calls it makes at once,
each alone over gRPC: ``list_call`` (ListLeases, the first page of 100) and
``stats_call`` (GetNamespaceStats of the namespace, whose figures the page
shows above the tasks).

The console runs inside the server process (``serve`` starts it beside the
gRPC port), so "server time" is that process's: the wall time of each
request on loopback (the page's whole answer, database waits included), and
the CPU time of the process's threads over each request (``/proc``
schedstat, nanoseconds). Around each window are read the server's
``leasekeeper_db_statements_total`` (less the statements it sends when idle:
the sweeper's) and the CPU time of the PostgreSQL backends serving the
size's database. The report gives p50 and p99 per page kind and size, and
the ratios of the largest size to the smallest: "flat" is a ratio near 1.
Nothing here asserts a speed; a page that does not answer 200 is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import asyncpg
import grpc
import httpx

from bench import scale
from bench.paired import BackendClock, backend_clock
from bench.procstat import cpu_seconds, thread_cpu_ns
from bench.servers import ServerTarget, leasekeeper_server, sibling_database
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as pb_grpc
from leasekeeper_server.console.runtime import PAGE_SIZE
from leasekeeper_server.rpc.paging import MAX_PAGE_SIZE
from leasekeeper_server.storage.migrate import migrate

NAMESPACE_PREFIX = "console"
NAMESPACE = scale.namespaces(NAMESPACE_PREFIX)[0]  # half the seeded rows
OWNER = "worker-7"  # one of the seed's 997 owners
STATE = "HELD"
PAGES = ("first", "deep", "state", "owner", "task", "namespaces")
# The two calls a tasks page makes, at once, timed alone over gRPC: where its time goes.
CALLS = ("list_call", "stats_call")
KINDS = (*PAGES, *CALLS)
TITLES = {
    "first": "tasks, first page",
    "deep": "tasks, a page half way",
    "state": f"tasks, state={STATE}",
    "owner": f"tasks, owner={OWNER}",
    "task": "one task",
    "namespaces": "namespaces",
    "list_call": "call: ListLeases (100)",
    "stats_call": "call: GetNamespaceStats",
}
TASK_PAGES = ("first", "deep", "state", "owner")  # the pages the target judges
TARGET_MS = 200.0
FLAT_WITHIN = 0.20
_CONSOLE_LINE = re.compile(r"leasekeeper console on (https?://\S+/)")
_TASK_ROW = 'data-testid="task-row"'
_TASK_ID = re.compile(r'<tr\b(?=[^>]*\bdata-testid="task-row")[^>]*\bdata-task-id="([^"]*)"')
IDLE_S = 3.0  # how long the server's idle statements are counted before the windows
POOL_MAX_SIZE = 10  # database connections of each size's server (a page makes a few calls)
# A held task with a live lease, preferring one with an effect (task ids
# ending in 0), a checkpoint and the most grants: the same kind of task at
# every size.
_SHOWN_TASK = """
SELECT task_id FROM leasekeeper_tasks
WHERE namespace = $1 AND state = 'held' AND expire_time > clock_timestamp()
  AND expiry_announced_fence IS DISTINCT FROM fence
ORDER BY right(task_id, 1) = '0' DESC, checkpoint_version IS NOT NULL DESC, fence DESC, task_id
LIMIT 1
"""


@dataclass(frozen=True)
class ConsolePlan:
    """How many tasks, and how many requests per page kind and size.

    Attributes:
        sizes: tasks in the measured namespace, one database and server each.
        requests: measured requests per page kind and size, over all rounds.
        rounds: windows per page kind and size (forwards, then backwards).
        warmup: unmeasured requests at the start of each window.
    """

    sizes: tuple[int, ...]
    requests: int
    rounds: int
    warmup: int

    @classmethod
    def of(cls, quick: bool, sizes: Sequence[int] | None = None) -> ConsolePlan:
        plan = cls((1_000, 10_000), 20, 2, 2) if quick else cls((100_000, 1_000_000), 200, 4, 3)
        if sizes:
            plan = cls(tuple(sorted(sizes)), plan.requests, plan.rounds, plan.warmup)
        return plan

    @property
    def per_window(self) -> int:
        return max(1, -(-self.requests // self.rounds))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) by nearest rank: the smallest value that at least
    q% of the values do not exceed; nan without values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def console_url(log_text: str) -> str | None:
    """The console's address from a server's log (``leasekeeper console on URL``), or None."""
    found = _CONSOLE_LINE.search(log_text)
    return found.group(1) if found else None


def page_path(kind: str, token: str = "", task_id: str = "") -> str:
    """The path and query of a page kind in namespace ``NAMESPACE``."""
    query: dict[str, str] = {"ns": NAMESPACE}
    if kind == "namespaces":
        return "/"
    if kind == "task":
        query["id"] = task_id
        return "/task?" + urlencode(query)
    if kind == "deep":
        query["page"] = token
    elif kind == "state":
        query["state"] = STATE
    elif kind == "owner":
        query["owner"] = OWNER
    return "/namespace?" + urlencode(query)


def task_rows(html: str) -> list[str]:
    """The task ids of a namespace page's rows, in order (HTML-escaped as rendered)."""
    return _TASK_ID.findall(html)


@dataclass
class PageSample:
    """What the requests of one page kind at one size saw.

    Attributes:
        wall_ms: each measured request's wall time on loopback, milliseconds.
        cpu_ms: the server's CPU time over each measured request, milliseconds.
        tick_cpu_s: the server's CPU time over the measured requests in clock
            ticks (``procstat.cpu_seconds``: the process and its children).
        db_cpu_s: the database backends' CPU time over them; None where not readable.
        statements: database statements the server sent over them, less its idle rate.
        errors: requests that did not answer 200, by status or exception name.
        rows: task rows on the page (namespace pages), as last rendered.
        bytes: the page's size, as last rendered.
    """

    wall_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    tick_cpu_s: float = 0.0
    db_cpu_s: float | None = 0.0
    statements: float | None = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    rows: int | None = None
    bytes: int = 0


@dataclass
class Size:
    """One seeded size: its database, server, console and pages."""

    tasks: int
    url: str
    server: ServerTarget
    console: str
    paths: dict[str, str]
    stub: pb_grpc.LeaseServiceStub
    table_rows: int = 0
    history_entries: int = 0
    seed_s: float = 0.0
    idle_statements_per_s: float = 0.0


def _spent(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    if before is None or after is None:
        return None
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


async def _request(http: httpx.AsyncClient, path: str) -> httpx.Response:
    reply = await http.get(path)
    if reply.status_code != 200:
        raise PageRefused(reply.status_code, reply.text[:500])
    return reply


class PageRefused(Exception):
    """A page answered with another status than 200."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status


async def _call(size: Size, kind: str) -> None:
    """One of ``CALLS``: the request a tasks page of ``NAMESPACE`` makes, over gRPC."""
    if kind == "list_call":
        request = pb.ListLeasesRequest(namespace=NAMESPACE, page_size=PAGE_SIZE, owner_id="")
        await size.stub.ListLeases(request, timeout=60)
    else:
        await size.stub.GetNamespaceStats(
            pb.GetNamespaceStatsRequest(namespace=NAMESPACE), timeout=60
        )


async def window(
    size: Size,
    kind: str,
    http: httpx.AsyncClient,
    clock: BackendClock,
    sample: PageSample,
    requests: int,
    warmup: int,
) -> None:
    """``warmup`` requests, then ``requests`` measured ones, one at a time; adds to ``sample``.

    A page is asked for over ``http``; a call of ``CALLS`` goes over gRPC.
    """
    pid = size.server.pid

    async def fetch() -> httpx.Response | None:
        if kind in CALLS:
            await _call(size, kind)
            return None
        return await _request(http, size.paths[kind])

    for _ in range(warmup):
        with contextlib.suppress(Exception):
            await fetch()
    st0 = size.server.statements()
    db0, ticks0 = await clock.read(), cpu_seconds(pid)
    began = time.perf_counter()
    last: httpx.Response | None = None
    for _ in range(requests):
        cpu0 = thread_cpu_ns(pid)
        t0 = time.perf_counter()
        try:
            last = await fetch()
        except Exception as exc:  # counted; the window goes on
            name = f"HTTP {exc.status}" if isinstance(exc, PageRefused) else type(exc).__name__
            sample.errors[name] = sample.errors.get(name, 0) + 1
            continue
        t1 = time.perf_counter()
        cpu1 = thread_cpu_ns(pid)
        sample.wall_ms.append((t1 - t0) * 1000)
        sample.cpu_ms.append((cpu1 - cpu0) / 1e6)
    elapsed = time.perf_counter() - began
    ticks1, db1 = cpu_seconds(pid), await clock.read()
    st1 = size.server.statements()
    sample.tick_cpu_s += ticks1 - ticks0
    spent = _spent(db0, db1)
    sample.db_cpu_s = None if sample.db_cpu_s is None or spent is None else sample.db_cpu_s + spent
    if st0 is None or st1 is None or sample.statements is None:
        sample.statements = None
    else:
        sample.statements += st1 - st0 - size.idle_statements_per_s * elapsed
    if last is not None:
        sample.bytes = len(last.content)
        if kind in TASK_PAGES:
            sample.rows = last.text.count(_TASK_ROW)


async def deep_token(address: str, tasks: int) -> tuple[str, int]:
    """The ListLeases page token half way through ``NAMESPACE``, by its page token chain.

    Follows the chain from the first page with pages of a twentieth of half
    ``tasks``, at most ``MAX_PAGE_SIZE`` (the page size is not bound into a
    token: the console's pages of 100 go on from it), and the console's
    filters (none).

    Returns:
        The token, and the tasks listed before it.

    Raises:
        RuntimeError: the listing ended before half way.
    """
    listed, token = 0, ""
    page_size = min(MAX_PAGE_SIZE, max(1, tasks // 40))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.LeaseServiceStub(channel)
        while listed < tasks // 2:
            reply = await stub.ListLeases(
                pb.ListLeasesRequest(
                    namespace=NAMESPACE, page_size=page_size, page_token=token, owner_id=""
                ),
                timeout=30,
            )
            listed += len(reply.leases)
            token = reply.next_page_token
            if not token:
                raise RuntimeError(f"{NAMESPACE} ended after {listed} tasks, before half way")
    return token, listed


async def idle_statements_per_s(server: ServerTarget, seconds: float = IDLE_S) -> float:
    """The statements a server sends per second with no request (its sweeper and pruner)."""
    before = server.statements()
    await asyncio.sleep(seconds)
    after = server.statements()
    if before is None or after is None:
        return 0.0
    return (after - before) / seconds


async def wait_console(server: ServerTarget, within_s: float = 30.0) -> str:
    """The console's address, once the server's log names it.

    Raises:
        RuntimeError: the log does not name it in time (no console).
    """
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        url = console_url(server.log_path.read_text(errors="replace"))
        if url:
            return url
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no console line in {server.log_path}")


async def _fetch(url: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def seeded_size(database_url: str, tasks: int, log_dir: Path) -> AsyncIterator[Size]:
    """A database of ``2 * tasks`` seeded rows (``tasks`` or so in ``NAMESPACE``), its server
    with the console, and the paths of its pages; all gone when the block ends."""
    async with sibling_database(database_url, f"console{tasks}") as url:
        began = time.monotonic()
        await migrate(url)
        await scale.seed(url, 2 * tasks, namespace=NAMESPACE_PREFIX)
        await _fetch(url, "CHECKPOINT")
        seed_s = time.monotonic() - began
        in_namespace = int(
            await _fetch(
                url, "SELECT count(*) FROM leasekeeper_tasks WHERE namespace = $1", NAMESPACE
            )
        )
        shown = await _fetch(url, _SHOWN_TASK, NAMESPACE)
        if shown is None:
            raise RuntimeError(f"{NAMESPACE} has no live lease to show")
        history = int(
            await _fetch(
                url, "SELECT reltuples FROM pg_class WHERE relname = 'leasekeeper_task_history'"
            )
        )
        async with (
            leasekeeper_server(
                url, log_dir, console_listen="127.0.0.1:0", pool_max_size=POOL_MAX_SIZE
            ) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            console = await wait_console(server)
            token, before = await deep_token(server.address, in_namespace)
            size = Size(
                in_namespace,
                url,
                server,
                console,
                {kind: page_path(kind, token=token, task_id=shown) for kind in PAGES},
                pb_grpc.LeaseServiceStub(channel),
                table_rows=2 * tasks,
                history_entries=history,
                seed_s=seed_s,
            )
            size.idle_statements_per_s = await idle_statements_per_s(server)
            print(
                f"console: {in_namespace:,} tasks in {NAMESPACE} ({2 * tasks:,} task rows, "
                f"{history:,} history entries; seeded in {seed_s:.0f} s); deep page after "
                f"{before:,} tasks; {size.idle_statements_per_s:.2f} idle statements/s; "
                f"console {console}",
                flush=True,
            )
            yield size


async def run(database_url: str, plan: ConsolePlan, log_dir: Path) -> dict[str, Any]:
    """Seeds each size, measures every page kind at every size; the figures for the report."""
    samples: dict[tuple[str, int], PageSample] = {}
    sizes: list[Size] = []
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        for tasks in plan.sizes:
            sizes.append(await stack.enter_async_context(seeded_size(database_url, tasks, log_dir)))
        clocks = [await stack.enter_async_context(backend_clock(s.url)) for s in sizes]
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=s.console, timeout=60))
            for s in sizes
        ]
        for i, size in enumerate(sizes):  # a session cookie each, and the first page's check
            first = await _request(clients[i], size.paths["first"])
            deep = await _request(clients[i], size.paths["deep"])
            shown_first, shown_deep = task_rows(first.text), task_rows(deep.text)
            if not shown_first or not shown_deep or shown_deep[0] <= shown_first[-1]:
                raise RuntimeError(
                    f"the deep page of {size.tasks:,} tasks does not follow the first"
                )
        order = list(range(len(sizes)))
        for r in range(plan.rounds):
            for kind in KINDS:
                for i in order if r % 2 == 0 else order[::-1]:
                    sample = samples.setdefault((kind, i), PageSample())
                    await window(
                        sizes[i], kind, clients[i], clocks[i], sample, plan.per_window, plan.warmup
                    )
    pages = []
    for kind in KINDS:
        for i, size in enumerate(sizes):
            pages.append(_page(kind, size, samples[(kind, i)]))
            p = pages[-1]
            print(
                f"  {TITLES[kind]:<24} {size.tasks:>10,} tasks  wall p50 {p['wall_p50_ms']:7.2f} "
                f"p99 {p['wall_p99_ms']:7.2f} ms  cpu p50 {p['cpu_p50_ms']:6.2f} "
                f"p99 {p['cpu_p99_ms']:6.2f} ms  db cpu {p['db_cpu_ms_per_page'] or 0:6.2f} ms "
                f"stmt {p['statements_per_page'] or 0:.2f}  rows {p['rows']}"
                + (f"  errors {p['errors']}" if p["errors"] else ""),
                flush=True,
            )
    result = {
        "elapsed_s": round(time.monotonic() - started, 1),
        "plan": asdict(plan),
        "namespace": NAMESPACE,
        "sizes": [
            {
                "tasks": s.tasks,
                "table_rows": s.table_rows,
                "history_entries": s.history_entries,
                "seed_s": round(s.seed_s, 1),
                "idle_statements_per_s": s.idle_statements_per_s,
            }
            for s in sizes
        ],
        "pages": pages,
    }
    result["ratios"] = ratios(pages)
    result["target"] = target(result)
    return result


def _page(kind: str, size: Size, sample: PageSample) -> dict[str, Any]:
    n = len(sample.wall_ms)
    return {
        "kind": kind,
        "title": TITLES[kind],
        "tasks": size.tasks,
        "requests": n,
        "errors": sample.errors,
        "wall_p50_ms": percentile(sample.wall_ms, 50),
        "wall_p99_ms": percentile(sample.wall_ms, 99),
        "cpu_p50_ms": percentile(sample.cpu_ms, 50),
        "cpu_p99_ms": percentile(sample.cpu_ms, 99),
        "tick_cpu_ms_per_page": sample.tick_cpu_s * 1000 / n if n else None,
        "db_cpu_ms_per_page": (
            sample.db_cpu_s * 1000 / n if n and sample.db_cpu_s is not None else None
        ),
        "statements_per_page": (
            sample.statements / n if n and sample.statements is not None else None
        ),
        "rows": sample.rows,
        "bytes": sample.bytes,
    }


def ratios(pages: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per page kind, the largest size's p50 wall and CPU time over the smallest size's."""
    found: dict[str, dict[str, float]] = {}
    for kind in dict.fromkeys(p["kind"] for p in pages):
        of_kind = sorted((p for p in pages if p["kind"] == kind), key=lambda p: p["tasks"])
        if len(of_kind) < 2:
            continue
        low, high = of_kind[0], of_kind[-1]
        found[kind] = {}
        for name in ("wall", "cpu"):
            a, b = high[f"{name}_p50_ms"], low[f"{name}_p50_ms"]
            if b > 0 and not (math.isnan(a) or math.isnan(b)):
                found[kind][name] = a / b
    return found


def target(result: dict[str, Any]) -> dict[str, Any]:
    """The target: every tasks page's p99 wall time at the largest size under ``TARGET_MS``,
    and its p50 at the largest size within ``FLAT_WITHIN`` of the smallest's."""
    pages = [p for p in result["pages"] if p["kind"] in TASK_PAGES]
    if not pages:
        return {
            "tasks": 0,
            "worst_p50_ms": None,
            "worst_p99_ms": None,
            "worst_ratio": None,
            "met": None,
        }
    largest = max(p["tasks"] for p in pages)
    at_largest = [p for p in pages if p["tasks"] == largest]
    worst = max(at_largest, key=lambda p: p["wall_p99_ms"])
    walls = [(k, r["wall"]) for k, r in result["ratios"].items() if k in TASK_PAGES and "wall" in r]
    worst_ratio = max(walls, key=lambda kr: kr[1]) if walls else None
    met = worst["wall_p99_ms"] < TARGET_MS and (
        worst_ratio is None or worst_ratio[1] <= 1 + FLAT_WITHIN
    )
    return {
        "tasks": largest,
        "worst_p50_ms": max(p["wall_p50_ms"] for p in at_largest),
        "worst_p99_ms": worst["wall_p99_ms"],
        "worst_p99_kind": worst["kind"],
        "worst_ratio": worst_ratio[1] if worst_ratio else None,
        "worst_ratio_kind": worst_ratio[0] if worst_ratio else None,
        "met": met,
    }

"""leasekeeper's capacity model: what a workload needs, from the per-operation costs measured.

Pure arithmetic and its rendering, no I/O: ``bench/capacity.py`` measures the
costs (and checks the model against two heartbeat fleets), this module turns
costs and a :class:`Workload` into an :class:`Estimate`, and renders the
markdown that ``docs/operations/capacity.md`` includes from
``bench/published/capacity.md``. The million-worker plan the page shows is
:data:`MILLION` with :data:`PRIMARY`'s budget, here and nowhere else.

The model, for W workers each holding one lease (ttl T, a beat every B
seconds), tasks lasting D seconds, G effect gateways validating V times a
second each, and E effects a second:

* rates (per second): renewals W/B, tasks (a Claim and its Release) W/D,
  fence checks G*V, effects (BeginEffect + CompleteEffect) E;
* leasekeeper cores = sum(rate x server CPU per op) + P x an idle server's
  CPU; provisioned x HEADROOM; server processes P: one core each at most;
* PostgreSQL cores = sum(rate x PostgreSQL CPU per op) + P x its idle CPU per
  server; provisioned x HEADROOM;
* WAL bytes/s = sum(rate x WAL bytes per op) + P x an idle server's WAL/s;
* statements/s = sum(rate x statements per op);
* table growth = sum(rate x the tables' growth per op) (tasks are never deleted);
* connections = P x (pool_max_size + the batch pool + the notification
  connection + the sweeper's);
* memory = P x an idle server's RSS + streams x RSS per open stream.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from bench.snippets import section

# The operations measured, in the order of the tables, and what one of them is.
OPS = ("heartbeat", "session", "task", "validate", "validate_stream", "effect")
TITLES = {
    "heartbeat": "Heartbeat renewal",
    "session": "Session renewal",
    "task": "Claim + Release (complete)",
    "validate": "ValidateFence (unary)",
    "validate_stream": "ValidateFences (stream)",
    "effect": "BeginEffect + CompleteEffect",
}
PER = {
    "heartbeat": "renewal (a beat on the lease's own stream)",
    "session": "renewal (one of 10 leases a Session beat renews)",
    "task": "task: its whole life but the renewals",
    "validate": "fence check",
    "validate_stream": "fence check (a gateway's checks share one stream)",
    "effect": "effect",
}

# Provisioned = needed x HEADROOM: room for bursts (a replica's workers all
# reconnecting and renewing at once after a failover), collector pauses, and a
# replica down for a rolling upgrade, without latency climbing toward the ttl.
HEADROOM = 1.5
# One server process is one Python interpreter: about one core at most.
PROCESS_CORES = 1.0
# A transaction pooler's PostgreSQL sessions per provisioned PostgreSQL core.
POOLER_SESSIONS_PER_CORE = 2
# Connections of a server process besides its call pool (storage/store.py:
# the batch pool's max_size; events.py's LISTEN; sweeper.py's election).
BATCH_POOL_CONNECTIONS = 5
DIRECT_CONNECTIONS = 2  # the notification listener and the sweeper election

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class OpCost:
    """What one operation costs, measured.

    Attributes:
        server_cpu_ms: leasekeeper server CPU, milliseconds.
        pg_cpu_ms: PostgreSQL CPU (every process of its cluster), milliseconds.
        statements: database statements the server sent (each BEGIN/COMMIT counts).
        wal_bytes: WAL the cluster wrote, bytes.
        table_bytes: what the database's tables (indexes and TOAST included) grew by,
            bytes: a task's row is never deleted (it carries the fence counter).
        rate_per_s: the operations per second it was measured at.
    """

    server_cpu_ms: float
    pg_cpu_ms: float
    statements: float
    wal_bytes: float
    table_bytes: float = 0.0
    rate_per_s: float = 0.0


@dataclass(frozen=True)
class Fixed:
    """What one server process costs whatever its load, and per open stream.

    Attributes:
        server_cpu_cores: an idle server process's CPU (health checks, sweeper), cores.
        pg_cpu_cores: PostgreSQL's CPU meanwhile (its background work included), cores.
        wal_bytes_s: WAL written meanwhile, bytes per second.
        rss_bytes: an idle server process's resident set size, bytes.
        rss_per_stream_bytes: the server's RSS per open Heartbeat stream, bytes.
        pool_max_size: the call pool's size (``LEASEKEEPER_POOL_MAX_SIZE``).
    """

    server_cpu_cores: float
    pg_cpu_cores: float
    wal_bytes_s: float
    rss_bytes: float
    rss_per_stream_bytes: float
    pool_max_size: int = 20

    @property
    def connections(self) -> int:
        """The most PostgreSQL connections one server process holds (direct, no pooler)."""
        return self.pool_max_size + BATCH_POOL_CONNECTIONS + DIRECT_CONNECTIONS


@dataclass(frozen=True)
class Costs:
    """The measured costs: per operation (:data:`OPS`; one missing was not measured) and fixed."""

    ops: dict[str, OpCost]
    fixed: Fixed

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Costs:
        """From ``capacity.json``'s ``costs``."""
        return cls(
            {name: OpCost(**cost) for name, cost in data["ops"].items()}, Fixed(**data["fixed"])
        )

    def to_json(self) -> dict[str, Any]:
        return {"ops": {k: asdict(v) for k, v in self.ops.items()}, "fixed": asdict(self.fixed)}


@dataclass(frozen=True)
class Workload:
    """What the deployment serves.

    Attributes:
        workers: W, each holding one lease at a time.
        ttl_s: T, the leases' ttl, seconds.
        beat_s: B, seconds between two renewals of a lease (``hold()`` beats
            every T/3); less than T.
        task_s: D, how long a task holds its lease, seconds; None: no task
            starts or ends (a fleet that only renews).
        gateways: G, effect gateways (services checking fences).
        validations_per_gateway_s: V, fence checks a gateway makes a second.
        effects_per_s: E, ledger effects (BeginEffect + CompleteEffect) a second.
        renewal: ``heartbeat`` (a stream per lease) or ``session`` (a
            worker's leases on one Session stream).
        validation: ``validate_stream`` (the client's default) or ``validate`` (unary).
    """

    workers: int
    ttl_s: float
    beat_s: float
    task_s: float | None = None
    gateways: int = 0
    validations_per_gateway_s: float = 0.0
    effects_per_s: float = 0.0
    renewal: Literal["heartbeat", "session"] = "heartbeat"
    validation: Literal["validate_stream", "validate"] = "validate_stream"

    def __post_init__(self) -> None:
        problems = {
            "workers": self.workers < 0,
            "ttl_s": not self.ttl_s > 0,
            "beat_s": not 0 < self.beat_s < self.ttl_s,
            "task_s": self.task_s is not None and not self.task_s > 0,
            "gateways": self.gateways < 0,
            "validations_per_gateway_s": self.validations_per_gateway_s < 0,
            "effects_per_s": self.effects_per_s < 0,
            "renewal": self.renewal not in ("heartbeat", "session"),
            "validation": self.validation not in ("validate_stream", "validate"),
        }
        bad = [name for name, wrong in problems.items() if wrong]
        if bad:
            raise ValueError(f"{bad[0]}: out of range ({getattr(self, bad[0])!r})")

    def rates(self) -> dict[str, float]:
        """Operations per second, by op name (:data:`OPS`)."""
        rates: dict[str, float] = {self.renewal: self.workers / self.beat_s}
        if self.task_s is not None:
            rates["task"] = self.workers / self.task_s
        if self.gateways and self.validations_per_gateway_s:
            rates[self.validation] = self.gateways * self.validations_per_gateway_s
        if self.effects_per_s:
            rates["effect"] = self.effects_per_s
        return rates


@dataclass(frozen=True)
class Estimate:
    """What a workload needs (:func:`estimate`).

    Attributes:
        rates: operations per second, by op.
        server_processes: P, ``leasekeeper serve`` processes (replicas x ``--workers``).
        server_cores: leasekeeper CPU needed, cores.
        pg_cores: PostgreSQL CPU needed, cores.
        wal_bytes_s: WAL written, bytes per second.
        statements_s: database statements per second.
        table_bytes_s: what the database's tables grow by, bytes per second.
        memory_bytes: the server processes' RSS, bytes.
        connections: PostgreSQL connections of the servers, direct (no pooler).
        streams: open streams (one per worker with heartbeats).
    """

    rates: dict[str, float]
    server_processes: int
    server_cores: float
    pg_cores: float
    wal_bytes_s: float
    statements_s: float
    table_bytes_s: float
    memory_bytes: float
    connections: int
    streams: int
    per_op: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def server_cores_provisioned(self) -> float:
        return self.server_cores * HEADROOM

    @property
    def pg_cores_provisioned(self) -> float:
        return self.pg_cores * HEADROOM

    @property
    def pooler_sessions(self) -> int:
        """PostgreSQL sessions behind a transaction pooler (PgBouncer ``default_pool_size``)."""
        return math.ceil(self.pg_cores_provisioned * POOLER_SESSIONS_PER_CORE)

    @property
    def pooled_connections(self) -> int:
        """PostgreSQL connections with a transaction pooler: its sessions + 2 direct per process."""
        return self.pooler_sessions + self.server_processes * DIRECT_CONNECTIONS


def estimate(workload: Workload, costs: Costs, processes: int | None = None) -> Estimate:
    """What ``workload`` needs, by the model in this module's docstring.

    Args:
        workload: the rates' inputs.
        costs: the measured costs; every op the workload uses must be in ``costs.ops``.
        processes: server processes; None: as many as the provisioned cores need
            (each at most PROCESS_CORES busy), at least 1.

    Raises:
        KeyError: an op of the workload that ``costs`` does not have.
    """
    rates = workload.rates()
    fixed = costs.fixed
    per_op = {
        op: {
            "server_cores": rate * costs.ops[op].server_cpu_ms / 1000,
            "pg_cores": rate * costs.ops[op].pg_cpu_ms / 1000,
            "wal_bytes_s": rate * costs.ops[op].wal_bytes,
            "statements_s": rate * costs.ops[op].statements,
            "table_bytes_s": rate * costs.ops[op].table_bytes,
        }
        for op, rate in rates.items()
    }
    ops_cores = sum(p["server_cores"] for p in per_op.values())
    if processes is None:
        # The least P with HEADROOM x (ops_cores + P x idle) <= P x PROCESS_CORES.
        spare = PROCESS_CORES - HEADROOM * fixed.server_cpu_cores
        processes = max(1, math.ceil(HEADROOM * ops_cores / spare - 1e-9))
    # With sessions, memory is still counted per lease as for a stream of its own: an upper
    # bound (a lease on a shared Session stream holds less).
    streams = workload.workers
    return Estimate(
        rates=rates,
        server_processes=processes,
        server_cores=ops_cores + processes * fixed.server_cpu_cores,
        pg_cores=sum(p["pg_cores"] for p in per_op.values()) + processes * fixed.pg_cpu_cores,
        wal_bytes_s=sum(p["wal_bytes_s"] for p in per_op.values()) + processes * fixed.wal_bytes_s,
        statements_s=sum(p["statements_s"] for p in per_op.values()),
        table_bytes_s=sum(p["table_bytes_s"] for p in per_op.values()),
        memory_bytes=processes * fixed.rss_bytes + streams * fixed.rss_per_stream_bytes,
        connections=processes * fixed.connections,
        streams=streams,
        per_op=per_op,
    )


@dataclass(frozen=True)
class Primary:
    """A budget for one PostgreSQL primary (assumptions, not measurements).

    Attributes:
        cores: the primary's cores.
        busy: the share of them leasekeeper may keep busy (the rest: vacuum,
            checkpoints, backups, replication, a burst).
        wal_bytes_s: WAL a second the primary, its synchronous standby's
            replay (one process) and the WAL archive keep up with.
        connections: PostgreSQL sessions it serves well (``max_connections``).
    """

    cores: int
    busy: float
    wal_bytes_s: float
    connections: int


# The million-worker plan of docs/operations/capacity.md: the page shows these.
MILLION = Workload(
    workers=1_000_000,
    ttl_s=30.0,
    beat_s=10.0,
    task_s=600.0,
    gateways=200,
    validations_per_gateway_s=100.0,
    effects_per_s=2 * 1_000_000 / 600.0,  # two ledger effects per task
)
PRIMARY = Primary(cores=64, busy=0.5, wal_bytes_s=100 * MiB, connections=500)


def ceilings(workload: Workload, costs: Costs, primary: Primary) -> dict[str, int]:
    """Workers of ``workload``'s shape one ``primary`` carries, by the resource that bounds it.

    Every rate of the workload grows with its workers (gateways too), so each
    figure is the workers at which that resource reaches the budget; server
    processes are not bounded (add replicas), their connections go through a
    transaction pooler (its sessions + 2 direct per process).
    """
    whole = estimate(workload, costs)
    per_worker_pg = whole.pg_cores_provisioned / workload.workers
    per_worker_wal = whole.wal_bytes_s / workload.workers
    # Pooled: the pooler's sessions follow PostgreSQL's cores; the direct ones, the processes.
    per_worker_conn = whole.pooled_connections / workload.workers
    return {
        "PostgreSQL CPU": int(primary.cores * primary.busy / per_worker_pg),
        "WAL": int(primary.wal_bytes_s / per_worker_wal),
        "connections (pooled)": int(primary.connections / per_worker_conn),
    }


# ---------------------------------------------------------------------------------------------
# Rendering: bench/published/capacity.md, the sections the docs page includes.


def _n(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def _ms(value: float) -> str:
    return f"{value:.3f}"


def _bytes(value: float) -> str:
    if value >= GiB:
        return f"{value / GiB:,.1f} GiB"
    if value >= MiB:
        return f"{value / MiB:,.1f} MiB"
    if value >= 1024:
        return f"{value / 1024:,.1f} KiB"
    return f"{value:,.0f} B"


def _off(predicted: float, measured: float) -> str:
    if not measured:
        return "-"
    return f"{(predicted - measured) / measured * 100:+.0f}%"


def check_rows(check: dict[str, Any], costs: Costs) -> list[tuple[str, float, float]]:
    """(figure, predicted, measured) of one measured fleet, predicted for one server process."""
    workload = Workload(workers=check["streams"], ttl_s=check["ttl_s"], beat_s=check["beat_s"])
    predicted = estimate(workload, costs, processes=1)
    measured = check["measured"]
    return [
        ("leasekeeper CPU, cores", predicted.server_cores, measured["server_cores"]),
        ("PostgreSQL CPU, cores", predicted.pg_cores, measured["pg_cores"]),
        ("WAL, bytes/s", predicted.wal_bytes_s, measured["wal_bytes_s"]),
        ("database statements/s", predicted.statements_s, measured["statements_s"]),
        ("server RSS, bytes", predicted.memory_bytes, measured["rss_bytes"]),
    ]


def _figure(name: str, value: float) -> str:
    if name.endswith("cores"):
        return f"{value:.3f}"
    if name.endswith("statements/s"):
        return _n(value)
    if "bytes/s" in name:
        return f"{_bytes(value)}/s"
    return _bytes(value)


def render(results: dict[str, Any]) -> str:
    """The markdown of ``results`` (``capacity.json``): sections the docs page includes."""
    run = results["run"]
    costs = Costs.from_json(results["costs"])
    fixed = costs.fixed
    out: list[str] = [
        "<!-- Generated by `.venv/bin/python -m bench.capacity --publish` from"
        " bench/published/capacity.json; do not edit. -->",
        "",
    ]
    load = run["load"]
    day = datetime.datetime.fromisoformat(run["started"])
    started = f"{day.day} {day:%B %Y}"
    out += section(
        "run",
        [
            f"Measured on {started} by `python -m bench.capacity` ({run['elapsed_s']:,.0f} s):"
            f" {run['machine']['cpus']} CPUs ({run['machine']['platform']}),"
            f" Python {run['machine']['python']}, {run['database']}; one `leasekeeper serve`"
            f" process (settings {', '.join(f'{k}={v}' for k, v in run['settings'].items())})."
            f" The machine was shared with other work: its 1-minute load average was"
            f" {load['min']:.2f} to {load['max']:.2f} (mean {load['mean']:.2f}) during the run.",
        ],
    )
    rows = [
        "| operation | per | server CPU ms | PostgreSQL CPU ms | statements | WAL bytes |"
        " table growth, bytes | measured at, ops/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for op in OPS:
        if op not in costs.ops:
            rows.append(
                f"| {TITLES[op]} | {PER[op]} | not measured: {_missing(results, op)} ||||||"
            )
            continue
        c = costs.ops[op]
        rows.append(
            f"| {TITLES[op]} | {PER[op]} | {_ms(c.server_cpu_ms)} | {_ms(c.pg_cpu_ms)} |"
            f" {c.statements:.2f} | {_n(c.wal_bytes)} | {_n(c.table_bytes)} |"
            f" {_n(c.rate_per_s)} |"
        )
    out += section("per-op", rows)
    out += section(
        "fixed",
        [
            "| per server process | measured |",
            "|---|---:|",
            f"| leasekeeper CPU, idle | {fixed.server_cpu_cores:.4f} cores |",
            f"| PostgreSQL CPU meanwhile (its background work included) |"
            f" {fixed.pg_cpu_cores:.4f} cores |",
            f"| WAL meanwhile | {_bytes(fixed.wal_bytes_s)}/s |",
            f"| RSS, idle | {_bytes(fixed.rss_bytes)} |",
            f"| RSS per open Heartbeat stream | {_bytes(fixed.rss_per_stream_bytes)} |",
            f"| PostgreSQL connections, at most | {fixed.connections}"
            f" ({fixed.pool_max_size} + {BATCH_POOL_CONNECTIONS} batch +"
            f" {DIRECT_CONNECTIONS} direct; {results['connections_seen']} seen in the run) |",
        ],
    )
    check_lines = [
        "| heartbeat streams | beat every | beats/s | figure | predicted | measured |"
        " off: (predicted - measured) / measured |",
        "|---:|---:|---:|---|---:|---:|---:|",
    ]
    for check in results["checks"]:
        for i, (name, predicted, measured) in enumerate(check_rows(check, costs)):
            head = (
                f"| {_n(check['streams'])} | {check['beat_s']:g} s |"
                f" {_n(check['measured']['beats_per_s'])} |"
                if i == 0
                else "| | | |"
            )
            check_lines.append(
                f"{head} {name} | {_figure(name, predicted)} | {_figure(name, measured)} |"
                f" {_off(predicted, measured)} |"
            )
    renewal_at = costs.ops["heartbeat"].rate_per_s
    check_lines.append("")
    for c in results["checks"]:
        rate = c["streams"] / c["beat_s"]
        check_lines.append(
            f"- {_n(c['streams'])} streams: {_n(rate)} beats/s on one server process"
            f" ({rate / renewal_at:.0%} of the rate the renewal cost was measured at);"
            f" {_n(c['acked'])} of {_n(c['sent'])} beats renewed in {c['duration_s']:g} s,"
            f" p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms; the load generator"
            f" used {c['measured']['driver_cores']:.2f} cores."
        )
    out += section("checks", check_lines)
    out += section("million", render_plan(MILLION, costs, PRIMARY))
    return "\n".join(out)


def _missing(results: dict[str, Any], op: str) -> str:
    return str(results.get("missing", {}).get(op, "no such RPC in the proto"))


def render_plan(workload: Workload, costs: Costs, primary: Primary) -> list[str]:
    """The plan's assumptions, its estimate, and how many workers one primary carries."""
    est = estimate(workload, costs)
    rates = est.rates
    w = workload
    lines = [
        "| assumption | value | rate |",
        "|---|---|---:|",
        f"| workers W, each holding one lease on its own Heartbeat stream | {_n(w.workers)} |"
        f" {_n(est.streams)} streams |",
        f"| ttl T, beat every B | {w.ttl_s:g} s, {w.beat_s:g} s |"
        f" {_n(rates[w.renewal])} renewals/s |",
    ]
    if w.task_s is not None:
        lines.append(
            f"| task duration D (a Claim, a Release) | {w.task_s / 60:g} min |"
            f" {_n(rates['task'])} tasks/s |"
        )
    if w.validation in rates:
        lines.append(
            f"| effect gateways G, each validating V a second ({TITLES[w.validation]}) |"
            f" {w.gateways} x {w.validations_per_gateway_s:g}/s |"
            f" {_n(rates[w.validation])} checks/s |"
        )
    if "effect" in rates:
        per_task = f" ({w.effects_per_s / rates['task']:g} per task)" if "task" in rates else ""
        lines.append(
            f"| ledger effects E{per_task} | {_n(w.effects_per_s)}/s |"
            f" {_n(rates['effect'])} effects/s |"
        )
    lines += [
        "",
        f"| resource | needed | provisioned (x {HEADROOM:g}) | of which renewals |",
        "|---|---:|---:|---:|",
        f"| leasekeeper CPU | {est.server_cores:,.1f} cores | {est.server_cores_provisioned:,.1f}"
        f" cores: {est.server_processes} server processes |"
        f" {_share(est, 'server_cores', w.renewal, est.server_cores)} |",
        f"| PostgreSQL CPU | {est.pg_cores:,.1f} cores | {est.pg_cores_provisioned:,.1f} cores |"
        f" {_share(est, 'pg_cores', w.renewal, est.pg_cores)} |",
        f"| WAL | {_bytes(est.wal_bytes_s)}/s ({_bytes(est.wal_bytes_s * 86400)} a day) | |"
        f" {_share(est, 'wal_bytes_s', w.renewal, est.wal_bytes_s)} |",
        f"| database statements | {_n(est.statements_s)}/s | |"
        f" {_share(est, 'statements_s', w.renewal, est.statements_s)} |",
        f"| table growth | {_bytes(est.table_bytes_s)}/s ({_bytes(est.table_bytes_s * 86400)}"
        " a day) | | |",
        f"| server memory (RSS) | {_bytes(est.memory_bytes)} |"
        f" {_bytes(est.memory_bytes / est.server_processes)} a process | |",
        f"| PostgreSQL connections, direct | {_n(est.connections)} | | |",
        f"| ... through a transaction pooler | {_n(est.pooled_connections)}"
        f" ({est.pooler_sessions} pooler sessions + {DIRECT_CONNECTIONS} direct a process) |"
        f" | |",
        "",
    ]
    ops_s = sum(rates.values())
    renewal_at = costs.ops[w.renewal].rate_per_s
    lines += [
        f"Each of the {est.server_processes} server processes carries about"
        f" {_n(ops_s / est.server_processes)} operations a second"
        f" ({_n(rates[w.renewal] / est.server_processes)} renewals), the renewal cost having been"
        f" measured at {_n(renewal_at)}/s on one process.",
        "",
    ]
    limits = ceilings(workload, costs, primary)
    bound = min(limits, key=lambda k: limits[k])
    lines += [
        f"One primary of {primary.cores} cores kept at most {primary.busy:.0%} busy,"
        f" {_bytes(primary.wal_bytes_s)}/s of WAL and {primary.connections} sessions"
        " (assumptions: replace them with your hardware's) carries, with this workload's shape:",
        "",
        "| bounded by | workers |",
        "|---|---:|",
        *(f"| {name} | {_n(count)} |" for name, count in limits.items()),
        "",
        f"The first bound is {bound}: {_n(limits[bound])} workers on one primary, so"
        f" {_n(workload.workers)} workers need {_clusters(workload.workers, limits[bound])}.",
    ]
    return lines


def _clusters(workers: int, per_cluster: int) -> str:
    needed = math.ceil(workers / per_cluster)
    if needed == 1:
        return f"one cluster, at {workers / per_cluster:.0%} of that bound"
    return f"{needed} clusters"


def _share(est: Estimate, key: str, op: str, total: float) -> str:
    return f"{est.per_op[op][key] / total:.0%}" if total else "-"

"""The suite's results as a Markdown table and a PNG chart (matplotlib)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench import cpu_per_op
from bench.scenarios import LEASES_PER_SESSION, TITLES
from bench.snippets import section

Point = dict[str, Any]


def _find(points: Iterable[Point], target: str, scenario: str, concurrency: int) -> Point | None:
    for p in points:
        if (p["target"], p["scenario"], p["concurrency"], p.get("rows")) == (
            target,
            scenario,
            concurrency,
            None,
        ):
            return p
    return None


def _num(value: float | None, fmt: str = "{:,.0f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}"


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown, in named sections the docs include (``bench/snippets.py``).

    Sections: ``run``, ``calls`` (each call against the bare gRPC stack), ``claims``
    (against raw asyncpg and etcd), ``cpu`` (where the CPU goes), ``before-after``,
    ``side-by-side``, ``targets``, ``scale``, ``console``, ``sessions``, ``cpu-per-op``;
    a part the run left out gives no section.
    """
    points = results["points"]
    scenarios = list(
        dict.fromkeys(
            p["scenario"] for p in points if p["target"] == "leasekeeper" and p.get("rows") is None
        )
    )
    levels = sorted({p["concurrency"] for p in points if p.get("rows") is None})
    run = [
        f"Run {results['started']} ({'quick' if results['quick'] else 'full'}), "
        f"{results['machine']['cpus']} CPUs, Python {results['machine']['python']}; "
        f"{results['elapsed_s']} s in all."
    ]
    targets = targets_table(results)
    if results["quick"]:
        targets = [
            "A quick run: windows of well under a second, 1,000 streams and small tables, to show",
            "the suite works. Its figures are noisy and the targets below are judged on a full",
            "run (make bench).",
            "",
            *targets,
        ]
    lines = [
        *section("run", run),
        *section("calls", calls_table(points, scenarios, levels)),
        *section("claims", claims_table(points, levels)),
        *section("cpu", cpu_budget(points, scenarios, results["machine"]["cpus"])),
        *section("before-after", before_after(points, scenarios, levels)),
        *section("side-by-side", side_by_side(results.get("comparisons", []))),
        *section("targets", targets),
        *section("scale", scale_table(points)),
        *section("console", console_table(results.get("console"))),
        *section("sessions", sessions_scale_section(results.get("sessions_scale"))),
        *section("cpu-per-op", cpu_per_op_section(results.get("cpu_per_op"))),
    ]
    return "\n".join(lines[:-1]) + "\n"


def calls_table(points: list[Point], scenarios: list[str], levels: list[int]) -> list[str]:
    """Each scenario at each concurrency against the no-op reference of the same call."""
    lines = [
        "Reference: the same client against a bare grpc.aio server of the same service whose "
        "handlers do no work (a no-op unary call; a bidi echo for Heartbeat).",
        "",
        "| scenario | concurrent | leasekeeper ops/s | reference ops/s | ratio | p50 ms | "
        "p99 ms | server CPU ms/call | DB statements/call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario in scenarios:
        for c in levels:
            ours = _find(points, "leasekeeper", scenario, c)
            ref = _find(points, "reference", scenario, c)
            if ours is None:
                continue
            lines.append(
                f"| {TITLES.get(scenario, scenario)} | {c} | {_num(ours['rate'])} | "
                f"{_num(ref['rate'] if ref else None)} | "
                f"{_ratio(ours['rate'], ref['rate'] if ref else None)} | "
                f"{_num(ours['p50_ms'], '{:.2f}')} | {_num(ours['p99_ms'], '{:.2f}')} | "
                f"{_num(ours['cpu_ms_per_call'], '{:.3f}')} | "
                f"{_num(ours['statements_per_call'], '{:.2f}')} |"
            )
    return lines


def claims_table(points: list[Point], levels: list[int]) -> list[str]:
    """Claims of distinct tasks against raw asyncpg (the same SQL) and etcd, if run."""
    if not any(p["target"] in ("asyncpg", "etcd") for p in points):
        return []
    lines = [
        "Claims (distinct tasks) against the parts they are built from and against etcd:",
        "",
        "| concurrent | leasekeeper ops/s | raw asyncpg, same SQL | ratio | "
        "etcd (lease grant + txn) | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in levels:
        ours = _find(points, "leasekeeper", "claim", c)
        raw = _find(points, "asyncpg", "claim", c)
        etcd = _find(points, "etcd", "claim", c)
        if ours is None:
            continue
        lines.append(
            f"| {c} | {_num(ours['rate'])} | {_num(raw['rate'] if raw else None)} | "
            f"{_ratio(ours['rate'], raw['rate'] if raw else None)} | "
            f"{_num(etcd['rate'] if etcd else None)} | "
            f"{_ratio(ours['rate'], etcd['rate'] if etcd else None)} |"
        )
    return lines


def _total(point: Point | None, *keys: str) -> float | None:
    if point is None or any(point.get(k) is None for k in keys):
        return None
    return sum(point[k] for k in keys)


def cpu_budget(points: list[Point], scenarios: list[str], cpus: int, level: int = 64) -> list[str]:
    """CPU per call of every process at ``level`` concurrent: where each call's cost goes.

    Load generator, server and PostgreSQL share the machine's cores, so
    ``cpus`` seconds of CPU per second over the total CPU per call bounds the
    rate a scenario can reach here, whatever the server does with its share.
    """
    rows = []
    for scenario in scenarios:
        ours = _find(points, "leasekeeper", scenario, level)
        ref = _find(points, "reference", scenario, level)
        keys = ("client_cpu_ms_per_call", "cpu_ms_per_call", "db_cpu_ms_per_call")
        ours_total, ref_total = _total(ours, *keys), _total(ref, *keys)
        if ours is None or ref is None or ours_total is None or ref_total is None:
            continue
        rows.append(
            f"| {TITLES.get(scenario, scenario)} | {_num(ours[keys[0]], '{:.3f}')} | "
            f"{_num(ours[keys[1]], '{:.3f}')} | {_num(ours[keys[2]], '{:.3f}')} | "
            f"{ours_total:.3f} | {_num(cpus * 1000 / ours_total)} | "
            f"{_num(ref[keys[0]], '{:.3f}')} | {_num(ref[keys[1]], '{:.3f}')} | "
            f"{_num(ref[keys[2]], '{:.3f}')} | {ref_total:.3f} | {_num(cpus * 1000 / ref_total)} | "
            f"{ref_total / ours_total:.2f} |"
        )
    if not rows:
        return []
    return [
        "",
        f"Where the CPU goes at {level} concurrent: ms of CPU per call of the load generator "
        "(client), the server and PostgreSQL (every postgres process: for the no-op reference, "
        "which sends no statement, the database's background work in its window), the rate "
        f"their sum allows on {cpus} cores (bound = {cpus} s of CPU per second / total), and "
        "the reference's total over leasekeeper's (the ratio the CPU alone predicts):",
        "",
        "| scenario | client | server | PostgreSQL | total | bound ops/s | "
        "reference client | reference server | reference PostgreSQL | reference total | "
        "reference bound ops/s | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def before_after(points: list[Point], scenarios: list[str], levels: list[int]) -> list[str]:
    """The same scenarios against the earlier version's server (``--baseline-src``), if run."""
    if not any(p["target"] == "before" for p in points):
        return []
    lines = [
        "",
        "Before and after (the earlier version's server measured in the same run):",
        "",
        "| scenario | concurrent | before ops/s | after ops/s | before ratio | after ratio | "
        "before p99 ms | after p99 ms | before CPU ms/call | after CPU ms/call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario in scenarios:
        for c in levels:
            old = _find(points, "before", scenario, c)
            new = _find(points, "leasekeeper", scenario, c)
            ref = _find(points, "reference", scenario, c)
            if old is None or new is None:
                continue
            ref_rate = ref["rate"] if ref else None
            lines.append(
                f"| {TITLES.get(scenario, scenario)} | {c} | {_num(old['rate'])} | "
                f"{_num(new['rate'])} | {_ratio(old['rate'], ref_rate)} | "
                f"{_ratio(new['rate'], ref_rate)} | {_num(old['p99_ms'], '{:.1f}')} | "
                f"{_num(new['p99_ms'], '{:.1f}')} | {_num(old['cpu_ms_per_call'], '{:.3f}')} | "
                f"{_num(new['cpu_ms_per_call'], '{:.3f}')} |"
            )
    return lines


def side_by_side(comparisons: list[dict[str, Any]]) -> list[str]:
    """The side-by-side comparisons (``bench/runs.py``): each pair's CPU per call and ratios."""
    if not comparisons:
        return []
    lines = [
        "",
        "Side by side: two ops in alternating windows of one run (A B, B A, ...), at "
        f"{max(c['concurrency'] for c in comparisons)} concurrent; server CPU per call (the "
        "server process), and the CPU per call of the PostgreSQL backends serving the side's "
        "database (statements and triggers; the ratio a target judges is the server's):",
        "",
        "| comparison | A | B | A ops/s | B ops/s | A server CPU ms/call | "
        "B server CPU ms/call | ratio | per window pair: lowest / median / highest | "
        "A PostgreSQL CPU ms/call | "
        "B PostgreSQL CPU ms/call | PostgreSQL ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for c in comparisons:
        if c["note"]:
            lines.append(f"| {c['title']} | {c['note']} | | | | | | | | | | |")
            continue
        a, b = c["a"], c["b"]
        rounds = sorted(c["rounds"])
        spread = (
            f"{rounds[0]:.2f} / {statistics.median(rounds):.2f} / {rounds[-1]:.2f}"
            if rounds
            else "-"
        )
        lines.append(
            f"| {c['title']} | {a['label']} | {b['label']} | {_num(a['rate'])} | "
            f"{_num(b['rate'])} | {_num(a['cpu_ms_per_call'], '{:.3f}')} | "
            f"{_num(b['cpu_ms_per_call'], '{:.3f}')} | {_num(c['ratio'], '{:.2f}')} | {spread} | "
            f"{_num(a['db_cpu_ms_per_call'], '{:.3f}')} | "
            f"{_num(b['db_cpu_ms_per_call'], '{:.3f}')} | {_num(c['db_ratio'], '{:.2f}')} |"
        )
    return lines


def targets_table(results: dict[str, Any]) -> list[str]:
    """Each target of the suite, what this run measured, and whether it was met."""
    points = results["points"]
    rows: list[tuple[str, str, bool | None]] = []

    def ratio_at(scenario: str, c: int, ref_target: str = "reference") -> float | None:
        ours = _find(points, "leasekeeper", scenario, c)
        ref = _find(points, ref_target, scenario, c)
        if ours is None or ref is None or not ref["rate"]:
            return None
        return float(ours["rate"] / ref["rate"])

    for scenario in ("claim", "renew", "validate"):
        r = ratio_at(scenario, 64)
        rows.append(
            (
                f"{TITLES[scenario]} at 64 concurrent ≥ 0.70 x no-op unary",
                _num(r, "{:.2f}"),
                None if r is None else r >= 0.70,
            )
        )
    r = ratio_at("heartbeat", 64)
    rows.append(
        (
            "Heartbeat renewals at 64 streams ≥ 0.70 x bidi echo",
            _num(r, "{:.2f}"),
            None if r is None else r >= 0.70,
        )
    )
    # Renewals per second through sessions against the bidi echo's messages per second
    # (Heartbeat's reference): a beat renews every lease of its session.
    session = _find(points, "leasekeeper", "session", 64)
    echo = _find(points, "reference", "heartbeat", 64)
    r = session["rate"] / echo["rate"] if session and echo and echo["rate"] else None
    rows.append(
        (
            f"Session renewals at 64 streams ({LEASES_PER_SESSION} leases each) ≥ 0.70 x bidi echo",
            _num(r, "{:.2f}"),
            None if r is None else r >= 0.70,
        )
    )
    r = ratio_at("claim", 64, "etcd")
    rows.append(
        ("Claims at 64 concurrent ≥ 5 x etcd", _num(r, "{:.2f}"), None if r is None else r >= 5)
    )
    rows += effect_targets(points)
    rows += validate_stream_targets(points)
    for scenario in ("claim", "renew", "validate"):
        ours = _find(points, "leasekeeper", scenario, 64)
        p99 = ours["p99_ms"] if ours else None
        rows.append(
            (
                f"{TITLES[scenario]} p99 at 64 concurrent < 20 ms",
                _num(p99, "{:.1f} ms"),
                None if p99 is None else p99 < 20,
            )
        )
    fleet = results.get("fleet")
    if fleet and "error" in fleet:
        rows.append((f"{fleet['streams']:,} heartbeat streams", f"failed: {fleet['error']}", False))
    elif fleet:
        rows.append(
            (
                f"{fleet['streams']:,} heartbeat streams: RSS < 1 GiB",
                f"{fleet['server_rss_bytes'] / 2**20:,.0f} MiB",
                fleet["server_rss_bytes"] < 2**30,
            )
        )
        rows.append(
            (
                f"{fleet['streams']:,} heartbeat streams: every beat acknowledged, p99 < 50 ms",
                f"{fleet['acked']:,}/{fleet['sent']:,} acked, p99 {fleet['p99_ms']:.1f} ms",
                fleet["acked"] == fleet["sent"] and fleet["p99_ms"] < 50,
            )
        )
    for c in results.get("comparisons", []):
        rows.append(
            (
                f"{c['title']}: server CPU per call ≤ {c['target']:.2f} x (side by side)",
                c["note"] or _num(c["ratio"], "{:.2f}"),
                c["met"],
            )
        )
    spread = results.get("scale_spread")
    if spread:
        for scenario, value in spread.items():
            rows.append(
                (
                    f"{TITLES[scenario]}: server CPU per call flat over table sizes (within 20%)",
                    f"{value * 100:.0f}% spread",
                    value <= 0.20,
                )
            )
    console = results.get("console")
    if console:
        rows.append(console_target(console))
    rows += sessions_scale_targets(results.get("sessions_scale"))
    rows += cpu_per_op_targets(results.get("cpu_per_op"))
    lines = ["| target | measured | met |", "|---|---:|:---:|"]
    for name, value, met in rows:
        lines.append(f"| {name} | {value} | {'-' if met is None else ('yes' if met else 'no')} |")
    return lines


Target = tuple[str, str, bool | None]

# Issue 20's targets of the effect ledger and of the streamed ValidateFence.
EFFECT_STATEMENTS = 3  # DB statements per BeginEffect+CompleteEffect pair, at most
EFFECT_CPU_RATIO = 1.5  # a pair's server CPU over a claim's, at most
VALIDATE_STREAM_RATIO = 2.0  # the stream's checks per second over unary ValidateFence's, at least
SESSIONS_RSS_BYTES = 2**30  # the sessions run's server RSS, under
SESSIONS_P99_MS = 50.0  # a renewal's p99 in the sessions run, under
CPU_PER_OP_GOAL = 1.0  # a claim's CPU (server + PostgreSQL) over etcd's, at most


def _cpu_ratio(a: Point | None, b: Point | None) -> float | None:
    """``a``'s server CPU per call over ``b``'s; None when either is missing."""
    if a is None or b is None or not a.get("cpu_ms_per_call") or not b.get("cpu_ms_per_call"):
        return None
    return float(a["cpu_ms_per_call"] / b["cpu_ms_per_call"])


def effect_targets(points: list[Point]) -> list[Target]:
    """BeginEffect+CompleteEffect: statements per pair alone and at 64, CPU beside a claim's.

    A call of the ``effect`` scenario is one pair, so its statements and CPU per
    call are the pair's; the claim is the ``claim`` scenario's point of the same run.
    """
    rows: list[Target] = []
    for c, how in ((1, "alone (1 concurrent)"), (64, "at 64 concurrent")):
        pair = _find(points, "leasekeeper", "effect", c)
        st = pair["statements_per_call"] if pair else None
        rows.append(
            (
                f"{TITLES['effect']}: DB statements per pair {how} ≤ {EFFECT_STATEMENTS}",
                _num(st, "{:.2f}"),
                None if st is None else st <= EFFECT_STATEMENTS,
            )
        )
    pair = _find(points, "leasekeeper", "effect", 64)
    claim = _find(points, "leasekeeper", "claim", 64)
    r = _cpu_ratio(pair, claim)
    rows.append(
        (
            f"{TITLES['effect']}: server CPU per pair at 64 concurrent ≤ {EFFECT_CPU_RATIO} x "
            "a claim's (same run)",
            "-"
            if r is None or pair is None or claim is None
            else f"{r:.2f} ({pair['cpu_ms_per_call']:.3f} / {claim['cpu_ms_per_call']:.3f} ms)",
            None if r is None else r <= EFFECT_CPU_RATIO,
        )
    )
    return rows


def validate_stream_targets(points: list[Point]) -> list[Target]:
    """The streamed ValidateFence's checks per second over the unary one's at 64 (≥ 2), and
    its server CPU per check over the unary one's (reported beside it, no target)."""
    stream = _find(points, "leasekeeper", "validate_stream", 64)
    unary = _find(points, "leasekeeper", "validate", 64)
    r = stream["rate"] / unary["rate"] if stream and unary and unary["rate"] else None
    cpu = _cpu_ratio(stream, unary)
    return [
        (
            f"{TITLES['validate_stream']} at 64 concurrent ≥ {VALIDATE_STREAM_RATIO:.0f} x "
            f"unary {TITLES['validate']} (same run)",
            _num(r, "{:.2f}"),
            None if r is None else r >= VALIDATE_STREAM_RATIO,
        ),
        (
            f"{TITLES['validate_stream']}: server CPU per check at 64 concurrent over unary "
            f"{TITLES['validate']}'s (no target)",
            _num(cpu, "{:.2f}"),
            None,
        ),
    ]


def _sessions_name(sessions: dict[str, Any]) -> str:
    return f"{sessions['leases']:,} leases through {sessions['sessions']:,} sessions, one server"


def sessions_scale_targets(sessions: dict[str, Any] | None) -> list[Target]:
    """The sessions run's targets (``bench/sessions_scale.py``): RSS under 1 GiB, every renewal
    acknowledged, a renewal's p99 under 50 ms; one failed row when it did not finish."""
    if not sessions:
        return []
    name = _sessions_name(sessions)
    if "error" in sessions:
        return [(name, f"failed: {sessions['error']}", False)]
    rss = sessions["server_rss_bytes_max"]
    sent, acked, errors = sessions["renewals_sent"], sessions["renewals_acked"], sessions["errors"]
    p99 = sessions["p99_ms"]
    return [
        (
            f"{name}: RSS < 1 GiB",
            f"{rss / 2**20:,.0f} MiB (highest with the sessions open)",
            rss < SESSIONS_RSS_BYTES,
        ),
        (
            f"{name}: every renewal acknowledged",
            f"{acked:,}/{sent:,} acked" + (f", {len(errors)} errors" if errors else ""),
            acked == sent and not errors,
        ),
        (
            f"{name}: renewal p99 < {SESSIONS_P99_MS:.0f} ms",
            f"p99 {p99:.1f} ms (p50 {sessions['p50_ms']:.1f}, max {sessions['max_ms']:.1f})",
            p99 < SESSIONS_P99_MS,
        ),
    ]


def sessions_scale_section(sessions: dict[str, Any] | None) -> list[str]:
    """The sessions run's figures (``bench/sessions_scale.py``), as a table of its own."""
    if not sessions:
        return []
    lines = ["", f"{_sessions_name(sessions)} (`bench/sessions_scale.py`):", ""]
    if "error" in sessions:
        return [*lines, f"failed: {sessions['error']}"]
    mib = 2**20
    figures = [
        ("leases per session", f"{sessions['leases_per_session']:,}"),
        (
            "a beat every, for, lease ttl",
            f"{sessions['interval_s']:g} s, {sessions['duration_s']:g} s, {sessions['ttl_s']:g} s",
        ),
        ("leases claimed in", f"{sessions['claim_s']:g} s"),
        (
            "renewals acknowledged / sent",
            f"{sessions['renewals_acked']:,} / {sessions['renewals_sent']:,}",
        ),
        ("renewals per second", f"{sessions['renewals_per_s']:,}"),
        (
            "renewal latency p50 / p99 / max",
            f"{sessions['p50_ms']:.1f} / {sessions['p99_ms']:.1f} / {sessions['max_ms']:.1f} ms",
        ),
        (
            "server RSS before the sessions / once open / highest with them open",
            f"{sessions['server_rss_bytes_before_sessions'] / mib:,.0f} / "
            f"{sessions['server_rss_bytes_sessions_open'] / mib:,.0f} / "
            f"{sessions['server_rss_bytes_max'] / mib:,.0f} MiB",
        ),
        ("server CPU per renewal", f"{sessions['server_cpu_ms_per_renewal']:.4f} ms"),
        ("server CPU share (CPU-s per s)", f"{sessions['server_cpu_share']:.2f}"),
        (
            "load average before / after (1/5/15 min)",
            f"{'/'.join(f'{x:.2f}' for x in sessions['load_before'])} / "
            f"{'/'.join(f'{x:.2f}' for x in sessions['load_after'])}",
        ),
    ]
    lines += ["| figure | value |", "|---|---:|"]
    lines += [f"| {name} | {value} |" for name, value in figures]
    if sessions["errors"]:
        lines += ["", "First errors: " + "; ".join(sessions["errors"])]
    return lines


def cpu_per_op_targets(cpu: dict[str, Any] | None) -> list[Target]:
    """CPU per operation beside etcd's (``bench/cpu_per_op.py``): a row per op, leasekeeper's
    server + PostgreSQL over etcd's server; the claim's goal is a ratio of 1 at most, the
    others are reported without a target."""
    if not cpu:
        return []
    if "error" in cpu:
        return [("CPU per op beside etcd", f"failed: {cpu['error']}", False)]
    rows: list[Target] = []
    for r in cpu["rows"]:
        goal = r["op"] == "claim"
        ratio = r["ratio"]
        rows.append(
            (
                f"CPU per op beside etcd ({r['op']}): {r['leasekeeper']}, server + PostgreSQL, "
                f"over etcd's {r['etcd']}"
                + (f" ≤ {CPU_PER_OP_GOAL:.1f} (goal)" if goal else " (no target)"),
                "-"
                if ratio is None
                else f"{ratio:.2f} ({r['total_ms']:.3f} / {r['etcd_ms']:.3f} ms)",
                ratio <= CPU_PER_OP_GOAL if goal and ratio is not None else None,
            )
        )
    return rows


def cpu_per_op_section(cpu: dict[str, Any] | None) -> list[str]:
    """CPU per operation beside etcd's: ``bench/cpu_per_op.py``'s table, note and profile."""
    if not cpu:
        return []
    lines = [
        "",
        "CPU per operation, leasekeeper (server + PostgreSQL) beside etcd's server, ms of CPU "
        f"per operation at {cpu.get('concurrency', '-')} concurrent (`bench/cpu_per_op.py`):",
        "",
    ]
    if "error" in cpu:
        return [*lines, f"failed: {cpu['error']}"]
    return lines + cpu_per_op.markdown(cpu).rstrip("\n").split("\n")


def scale_table(points: list[Point]) -> list[str]:
    scaled = [p for p in points if p.get("rows") is not None]
    if not scaled:
        return []
    lines = [
        "Cost per call against the table size (64 concurrent; each size its own database and "
        "server, the sizes measured in turn, forwards then backwards; PostgreSQL: the backends "
        "serving that size's server):",
        "",
        "| scenario | task rows | history entries | ops/s | p50 ms | p99 ms | "
        "server CPU ms/call | PostgreSQL CPU ms/call | DB statements/call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(scaled, key=lambda p: (p["scenario"], p["rows"])):
        lines.append(
            f"| {TITLES.get(p['scenario'], p['scenario'])} | {p['rows']:,} | "
            f"{_num(p.get('extra', {}).get('history_entries'))} | {_num(p['rate'])} | "
            f"{_num(p['p50_ms'], '{:.2f}')} | {_num(p['p99_ms'], '{:.2f}')} | "
            f"{_num(p['cpu_ms_per_call'], '{:.3f}')} | "
            f"{_num(p.get('db_cpu_ms_per_call'), '{:.3f}')} | "
            f"{_num(p['statements_per_call'], '{:.2f}')} |"
        )
    return lines


def chart(results: dict[str, Any], path: Path) -> None:
    """Two panels: ratio to reference per scenario and concurrency; ops/s against table size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = results["points"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    scenarios = list(
        dict.fromkeys(
            p["scenario"] for p in points if p["target"] == "leasekeeper" and p.get("rows") is None
        )
    )
    levels = sorted({p["concurrency"] for p in points if p.get("rows") is None})
    width = 0.8 / max(len(levels), 1)
    for i, c in enumerate(levels):
        ratios = []
        for scenario in scenarios:
            ours = _find(points, "leasekeeper", scenario, c)
            ref = _find(points, "reference", scenario, c)
            ratios.append(ours["rate"] / ref["rate"] if ours and ref and ref["rate"] else 0.0)
        left.bar(
            [x + i * width for x in range(len(scenarios))], ratios, width, label=f"{c} concurrent"
        )
    left.axhline(0.7, color="grey", linestyle="--", linewidth=1, label="target 0.70")
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(scenarios))])
    left.set_xticklabels([TITLES.get(s, s) for s in scenarios], rotation=20, ha="right", fontsize=8)
    left.set_ylabel("ops/s ÷ reference ops/s (no-op unary; bidi echo)")
    left.set_title("leasekeeper against the bare gRPC stack")
    left.legend(fontsize=8)

    scaled = [p for p in points if p.get("rows") is not None and p.get("cpu_ms_per_call")]
    for scenario in dict.fromkeys(p["scenario"] for p in scaled):
        series = sorted((p for p in scaled if p["scenario"] == scenario), key=lambda p: p["rows"])
        right.plot(
            [p["rows"] for p in series],
            [p["cpu_ms_per_call"] for p in series],
            marker="o",
            label=TITLES.get(scenario, scenario),
        )
    right.set_xscale("log")
    right.set_ylim(bottom=0)
    right.set_xlabel("task rows in the table")
    right.set_ylabel("server CPU ms per call at 64 concurrent")
    right.set_title("cost per call against the table size (the flatness target)")
    if scaled:
        right.legend(fontsize=8)
    fig.suptitle(
        f"leasekeeper bench {results['started']} ({'quick' if results['quick'] else 'full'}), "
        f"{results['machine']['cpus']} CPUs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def console_target(console: dict[str, Any]) -> tuple[str, str, bool | None]:
    """The console's target row: tasks pages under 200 ms at the largest size, flat within 20%."""
    t = console["target"]
    name = (
        f"Console tasks page < 200 ms server time at {t['tasks']:,} tasks, flat within 20% "
        "(p99 wall time; p50 ratio to the smallest size)"
    )
    if t["worst_p99_ms"] is None:
        return name, "-", None
    value = f"p99 {t['worst_p99_ms']:.1f} ms ({t['worst_p99_kind']}; p50 at most "
    value += f"{t['worst_p50_ms']:.1f} ms)"
    if t["worst_ratio"] is not None:
        value += f", ratio {t['worst_ratio']:.2f} ({t['worst_ratio_kind']})"
    return name, value, t["met"]


def console_table(console: dict[str, Any] | None) -> list[str]:
    """The console's pages at each namespace size (``bench/console.py``)."""
    if not console:
        return []
    sizes = console["sizes"]
    ratios = console.get("ratios", {})
    largest = max(s["tasks"] for s in sizes)
    smallest = min(s["tasks"] for s in sizes)
    seeded = "; ".join(
        f"{s['tasks']:,} tasks ({s['table_rows']:,} task rows, "
        f"{s['history_entries']:,} history entries, seeded in {s['seed_s']:.0f} s)"
        for s in sizes
    )
    lines = [
        "",
        f"The console's pages against the namespace's size ({console['namespace']}: {seeded}), "
        f"{console['plan']['requests']} requests per page and size, one at a time, in windows "
        "rotating over the sizes. Server time is the `leasekeeper serve` process's, which "
        "runs the console: the wall time of each request on loopback, and the CPU time of "
        "its threads over each request; PostgreSQL: the backends serving that size's "
        "database; statements: the server's, less those it sends when idle. The calls: the "
        "two a tasks page makes at once, each alone over gRPC. Ratio: the "
        f"p50 at {largest:,} tasks over the p50 at {smallest:,}.",
        "",
        "| page or call | tasks | p50 ms | p99 ms | server CPU p50 ms | server CPU p99 ms | "
        "PostgreSQL CPU ms/page | DB statements/page | rows shown | wall ratio | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in console["pages"]:
        ratio = ratios.get(p["kind"], {}) if p["tasks"] == largest else {}
        lines.append(
            f"| {p['title']} | {p['tasks']:,} | {_num(p['wall_p50_ms'], '{:.1f}')} | "
            f"{_num(p['wall_p99_ms'], '{:.1f}')} | {_num(p['cpu_p50_ms'], '{:.1f}')} | "
            f"{_num(p['cpu_p99_ms'], '{:.1f}')} | {_num(p['db_cpu_ms_per_page'], '{:.1f}')} | "
            f"{_num(p['statements_per_page'], '{:.1f}')} | {_num(p['rows'])} | "
            f"{_num(ratio.get('wall'), '{:.2f}')} | {_num(ratio.get('cpu'), '{:.2f}')} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.report FOLDER``: write FOLDER's results.md and results.png again from
    its results.json (after a change to the rendering; the figures are the run's)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    parser.add_argument("folder", type=Path, help="a folder holding a run's results.json")
    parser.add_argument("--no-chart", action="store_true", help="leave results.png as it is")
    args = parser.parse_args(argv)
    results = json.loads((args.folder / "results.json").read_text())
    (args.folder / "results.md").write_text(markdown(results))
    if not args.no_chart:
        chart(results, args.folder / "results.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 20's targets in the suite's report: each judged from a synthetic run's figures.

The effect ledger's statements and CPU beside a claim's, the streamed
ValidateFence's gain, the leases held through sessions and CPU per operation
beside etcd: each row's measured ratio is computed from the points (or the
parts' figures) given here, and its threshold decides "yes", "no" or "-".
"""

from __future__ import annotations

from typing import Any

from bench import cpu_per_op
from bench.report import (
    cpu_per_op_section,
    markdown,
    sessions_scale_section,
    targets_table,
)
from bench.run import Plan, parse_args, part_failures


def _point(scenario: str, concurrency: int, **figures: float | None) -> dict[str, Any]:
    point: dict[str, Any] = {
        "target": "leasekeeper",
        "scenario": scenario,
        "concurrency": concurrency,
        "rows": None,
        "rate": 1000.0,
        "p50_ms": 1.0,
        "p99_ms": 5.0,
        "calls": 1000,
        "errors": {},
        "cpu_ms_per_call": None,
        "statements_per_call": None,
    }
    point.update(figures)
    return point


def _row(lines: list[str], start: str) -> list[str]:
    """The cells of the one targets row whose name starts with ``start``."""
    found = [line for line in lines if line.startswith(f"| {start}")]
    assert len(found) == 1, (start, found)
    return [cell.strip() for cell in found[0].strip("|").split("|")]


def _results(points: list[dict[str, Any]], **parts: Any) -> dict[str, Any]:
    return {
        "points": points,
        "quick": False,
        "started": "2026-12-05T08:00:00Z",
        "elapsed_s": 1.0,
        "machine": {"cpus": 2, "python": "3.11"},
        **parts,
    }


EFFECT = "BeginEffect+CompleteEffect: "
STREAM = "ValidateFence (stream) at 64"
STREAM_CPU = "ValidateFence (stream): server CPU"


def test_effect_rows_judge_statements_per_pair_and_cpu_against_the_claims() -> None:
    points = [
        _point("effect", 1, statements_per_call=2.0, cpu_ms_per_call=0.5),
        _point("effect", 64, statements_per_call=2.02, cpu_ms_per_call=0.45),
        _point("claim", 64, cpu_ms_per_call=0.36),
    ]
    lines = targets_table({"points": points})
    assert _row(lines, f"{EFFECT}DB statements per pair alone")[1:] == ["2.00", "yes"]
    assert _row(lines, f"{EFFECT}DB statements per pair at 64")[1:] == ["2.02", "yes"]
    # 0.45 / 0.36 = 1.25: within 1.5
    assert _row(lines, f"{EFFECT}server CPU")[1:] == ["1.25 (0.450 / 0.360 ms)", "yes"]

    points[1].update(statements_per_call=3.4, cpu_ms_per_call=0.63)  # 0.63 / 0.36 = 1.75
    lines = targets_table({"points": points})
    assert _row(lines, f"{EFFECT}DB statements per pair at 64")[1:] == ["3.40", "no"]
    assert _row(lines, f"{EFFECT}server CPU")[1:] == ["1.75 (0.630 / 0.360 ms)", "no"]


def test_effect_rows_say_dash_when_a_point_is_missing() -> None:
    lines = targets_table({"points": [_point("effect", 64, cpu_ms_per_call=0.45)]})
    assert _row(lines, f"{EFFECT}DB statements per pair alone")[1:] == ["-", "-"]
    assert _row(lines, f"{EFFECT}DB statements per pair at 64")[1:] == ["-", "-"]
    assert _row(lines, f"{EFFECT}server CPU")[1:] == ["-", "-"]  # no claim in this run


def test_streamed_validation_must_double_the_unary_rate_of_the_same_run() -> None:
    points = [
        _point("validate", 64, rate=2000.0, cpu_ms_per_call=0.25),
        _point("validate_stream", 64, rate=5000.0, cpu_ms_per_call=0.06),
    ]
    lines = targets_table({"points": points})
    assert _row(lines, STREAM)[1:] == ["2.50", "yes"]
    assert _row(lines, STREAM_CPU)[1:] == ["0.24", "-"]  # 0.06 / 0.25, no target
    points[1]["rate"] = 3000.0
    assert _row(targets_table({"points": points}), STREAM)[1:] == ["1.50", "no"]
    lines = targets_table({"points": points[:1]})
    assert _row(lines, STREAM)[1:] == ["-", "-"]
    assert _row(lines, STREAM_CPU)[1:] == ["-", "-"]


def _sessions(**figures: Any) -> dict[str, Any]:
    sessions: dict[str, Any] = {
        "leases": 100_000,
        "sessions": 1_000,
        "leases_per_session": 100,
        "interval_s": 30.0,
        "duration_s": 90.0,
        "ttl_s": 90.0,
        "claim_s": 61.0,
        "renewals_sent": 300_000,
        "renewals_acked": 300_000,
        "errors": [],
        "renewals_per_s": 3333,
        "p50_ms": 12.5,
        "p99_ms": 41.0,
        "max_ms": 80.0,
        "server_rss_bytes_before_sessions": 300 * 2**20,
        "server_rss_bytes_sessions_open": 700 * 2**20,
        "server_rss_bytes_max": 760 * 2**20,
        "server_cpu_ms_per_renewal": 0.0421,
        "server_cpu_share": 0.14,
        "load_before": [1.0, 1.5, 2.0],
        "load_after": [2.0, 1.75, 2.0],
    }
    sessions.update(figures)
    return sessions


SESSIONS = "100,000 leases through 1,000 sessions, one server: "


def test_sessions_rows_judge_rss_acknowledgements_and_p99() -> None:
    lines = targets_table({"points": [], "sessions_scale": _sessions()})
    assert _row(lines, f"{SESSIONS}RSS")[1:] == ["760 MiB (highest with the sessions open)", "yes"]
    assert _row(lines, f"{SESSIONS}every renewal")[1:] == ["300,000/300,000 acked", "yes"]
    assert _row(lines, f"{SESSIONS}renewal p99")[1:] == [
        "p99 41.0 ms (p50 12.5, max 80.0)",
        "yes",
    ]
    worse = _sessions(
        server_rss_bytes_max=2**30, renewals_acked=299_900, errors=["beat 3 answered EOF"]
    )
    worse["p99_ms"] = 50.0
    lines = targets_table({"points": [], "sessions_scale": worse})
    assert _row(lines, f"{SESSIONS}RSS")[1:] == ["1,024 MiB (highest with the sessions open)", "no"]
    assert _row(lines, f"{SESSIONS}every renewal")[1:] == [
        "299,900/300,000 acked, 1 errors",
        "no",
    ]
    assert _row(lines, f"{SESSIONS}renewal p99")[2] == "no"
    # every renewal answered, but a stream reported an error: not met either
    lines = targets_table({"points": [], "sessions_scale": _sessions(errors=["UNAVAILABLE: x"])})
    assert _row(lines, f"{SESSIONS}every renewal")[2] == "no"


def test_sessions_that_did_not_finish_are_one_failed_row_and_a_failure_of_the_run() -> None:
    failed = {"leases": 100_000, "sessions": 1_000, "error": "AssertionError('3 claims refused')"}
    lines = targets_table({"points": [], "sessions_scale": failed})
    name = SESSIONS.rstrip(": ")
    assert _row(lines, name)[1:] == ["failed: AssertionError('3 claims refused')", "no"]
    assert sessions_scale_section(failed)[-1] == "failed: AssertionError('3 claims refused')"
    assert part_failures({"sessions_scale": failed}) == [
        "sessions scale: failed: AssertionError('3 claims refused')"
    ]
    assert part_failures({"sessions_scale": _sessions(renewals_acked=299_000)}) == [
        "sessions scale: 1,000 renewals not acknowledged, errors []"
    ]
    assert part_failures({"sessions_scale": _sessions(), "cpu_per_op": None}) == []


def test_sessions_section_lists_the_runs_figures() -> None:
    lines = sessions_scale_section(_sessions())
    assert "| renewal latency p50 / p99 / max | 12.5 / 41.0 / 80.0 ms |" in lines
    assert "| server RSS before the sessions / once open / highest with them open | " in "".join(
        lines
    )
    assert any("300 / 700 / 760 MiB" in line for line in lines)
    assert sessions_scale_section(None) == []


def _op_row(op: str, label: str, total_ms: float | None, etcd_ms: float) -> dict[str, Any]:
    ratio = total_ms / etcd_ms if total_ms is not None else None
    return {
        "op": op,
        "leasekeeper": label,
        "server_ms": total_ms,
        "postgres_ms": 0.0 if total_ms is not None else None,
        "total_ms": total_ms,
        "etcd": f"etcd {op}",
        "etcd_ms": etcd_ms,
        "ratio": ratio,
        "backends_ms": None,
        "backends_ratio": None,
        "leasekeeper_rate": 1000.0,
        "etcd_rate": 1000.0,
    }


def _cpu(claim_total_ms: float, profile: list[str]) -> dict[str, Any]:
    return {
        "concurrency": 64,
        "rows": [
            _op_row("claim", "Claim", claim_total_ms, 0.4),
            _op_row("renew", "Renew (unary)", 0.45, 0.05),
            _op_row("validate", "ValidateFence (unary)", None, 0.14),
        ],
        "note": "2026-12-05 08:00 UTC, 2 CPUs, 64 concurrent, 5.0 s windows.",
        "claim_profile": profile,
        "failed_windows": [],
    }


CPU = "CPU per op beside etcd "


def test_cpu_per_op_rows_judge_the_claim_against_the_goal_and_report_the_rest() -> None:
    lines = targets_table({"points": [], "cpu_per_op": _cpu(0.32, [])})
    assert _row(lines, f"{CPU}(claim)")[1:] == ["0.80 (0.320 / 0.400 ms)", "yes"]
    assert _row(lines, f"{CPU}(renew)")[1:] == ["9.00 (0.450 / 0.050 ms)", "-"]
    assert _row(lines, f"{CPU}(validate)")[1:] == ["-", "-"]
    lines = targets_table({"points": [], "cpu_per_op": _cpu(0.52, [])})
    assert _row(lines, f"{CPU}(claim)")[1:] == ["1.30 (0.520 / 0.400 ms)", "no"]
    failed = {"concurrency": 64, "error": "FileNotFoundError('etcd not found')"}
    lines = targets_table({"points": [], "cpu_per_op": failed})
    assert _row(lines, "CPU per op beside etcd")[1:] == [
        "failed: FileNotFoundError('etcd not found')",
        "no",
    ]
    assert part_failures({"cpu_per_op": failed}) == [
        "cpu per op: failed: FileNotFoundError('etcd not found')"
    ]
    windows = {**_cpu(0.32, []), "failed_windows": ["etcd Range of the key"]}
    assert part_failures({"cpu_per_op": windows}) == [
        "cpu per op: windows with errors or no ops: ['etcd Range of the key']"
    ]


def test_cpu_per_op_section_is_the_scripts_table_note_and_profile() -> None:
    profile = [" 41.0%  gRPC (cygrpc, C-core, socket I/O)", "top leaf frames of 900 busy samples:"]
    lines = cpu_per_op_section(_cpu(0.32, profile))
    table = [line for line in lines if line.startswith("| ")]
    assert table[1].split("|")[8].strip() == "0.80"  # the claim's ratio, computed above
    assert table[3].split("|")[8].strip() == "-"  # no ops to divide by: a dash, not "nan"
    assert "2026-12-05 08:00 UTC, 2 CPUs, 64 concurrent, 5.0 s windows." in lines
    assert lines[-4:] == [cpu_per_op.PROFILE_HEADING, "", *[f"    {p}" for p in profile]]
    assert cpu_per_op_section({"concurrency": 64, "error": "boom"})[-1] == "failed: boom"
    assert cpu_per_op_section(None) == []


def test_markdown_carries_the_parts_sections_and_their_target_rows() -> None:
    points = [
        _point("claim", 64, cpu_ms_per_call=0.36),
        _point("effect", 64, statements_per_call=2.0, cpu_ms_per_call=0.45),
    ]
    text = markdown(_results(points, sessions_scale=_sessions(), cpu_per_op=_cpu(0.32, [])))
    assert "(`bench/sessions_scale.py`):" in text
    assert "(`bench/cpu_per_op.py`):" in text
    assert f"| {SESSIONS}every renewal acknowledged | 300,000/300,000 acked | yes |" in text
    assert f"| {EFFECT}server CPU per pair" in text
    bare = markdown(_results(points))
    assert "sessions_scale.py" not in bare and "cpu_per_op.py" not in bare


def test_only_runs_one_part_and_no_etcd_leaves_cpu_per_op_out() -> None:
    args = parse_args(["--only", "sessions-scale"])
    assert not args.no_sessions_scale and args.no_cpu_per_op
    assert args.no_scale and args.no_console and args.no_comparisons and args.no_fleet
    assert args.scenarios == []
    args = parse_args(["--only", "cpu-per-op"])
    assert not args.no_cpu_per_op and args.no_sessions_scale
    assert parse_args(["--no-etcd"]).no_cpu_per_op
    args = parse_args([])
    assert not args.no_cpu_per_op and not args.no_sessions_scale
    assert parse_args(["--no-sessions-scale"]).no_sessions_scale


def test_quick_plan_holds_the_parts_small_and_the_full_one_at_the_issues_size() -> None:
    full, quick = Plan.of(False), Plan.of(True)
    assert full.sessions[:2] == (100_000, 1_000) and full.cpu_profile
    leases, sessions, interval_s, duration_s, ttl_s = quick.sessions
    assert leases * 10 <= full.sessions[0] and sessions * 10 <= full.sessions[1]
    assert duration_s < 10 and ttl_s > interval_s  # a short run; each beat keeps its leases
    assert not quick.cpu_profile and quick.cpu_duration_s < full.cpu_duration_s

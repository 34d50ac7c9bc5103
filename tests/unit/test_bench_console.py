"""The console benchmark's pure parts: its pages' addresses, its figures, and its report."""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

from bench import console
from bench.procstat import thread_cpu_ns
from bench.report import console_table, targets_table


def test_console_url_is_read_from_the_servers_log_line() -> None:
    log = (
        "leasekeeper serving on 127.0.0.1:0 (port 4242)\n"
        "leasekeeper console on http://127.0.0.1:39017/\n"
    )
    assert console.console_url(log) == "http://127.0.0.1:39017/"
    assert console.console_url("leasekeeper serving on 127.0.0.1:0 (port 4242)\n") is None


def test_page_paths_carry_the_namespace_and_each_kinds_filter_in_the_query() -> None:
    token = "AQ-_x=="
    paths = {kind: console.page_path(kind, token=token, task_id="a b&c") for kind in console.KINDS}
    assert paths["namespaces"] == "/"
    queries = {kind: parse_qs(urlsplit(path).query) for kind, path in paths.items()}
    assert queries["first"] == {"ns": [console.NAMESPACE]}
    assert queries["deep"] == {"ns": [console.NAMESPACE], "page": [token]}
    assert queries["state"] == {"ns": [console.NAMESPACE], "state": [console.STATE]}
    assert queries["owner"] == {"ns": [console.NAMESPACE], "owner": [console.OWNER]}
    assert urlsplit(paths["task"]).path == "/task"
    assert queries["task"] == {"ns": [console.NAMESPACE], "id": ["a b&c"]}


def test_task_rows_lists_a_namespace_pages_task_ids_in_order() -> None:
    html = (
        '<tr data-testid="task-row" data-task-id="task-0000000002"><td>..</td></tr>'
        '<tr data-task-id="task-0000000010" class="x" data-testid="task-row"><td>..</td></tr>'
        '<tr data-testid="timeline-entry" data-task-id="not-a-row"><td>..</td></tr>'
    )
    assert console.task_rows(html) == ["task-0000000002", "task-0000000010"]
    assert console.task_rows("<p>No tasks.</p>") == []


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted
    assert console.percentile(values, 50) == 50.0
    assert console.percentile(values, 99) == 99.0
    assert console.percentile([7.0], 99) == 7.0
    assert console.percentile([], 50) != console.percentile([], 50)  # nan


def test_plan_quick_is_small_and_sizes_given_replace_the_defaults() -> None:
    assert console.ConsolePlan.of(False).sizes == (100_000, 1_000_000)
    quick = console.ConsolePlan.of(True)
    assert max(quick.sizes) <= 10_000
    assert console.ConsolePlan.of(False, [1_000_000, 50_000]).sizes == (50_000, 1_000_000)
    assert console.ConsolePlan(sizes=(1,), requests=10, rounds=4, warmup=0).per_window == 3


def _page(kind: str, tasks: int, p50: float, p99: float, cpu: float = 10.0) -> dict[str, Any]:
    return {
        "kind": kind,
        "title": console.TITLES[kind],
        "tasks": tasks,
        "requests": 100,
        "errors": {},
        "wall_p50_ms": p50,
        "wall_p99_ms": p99,
        "cpu_p50_ms": cpu,
        "cpu_p99_ms": cpu * 1.5,
        "tick_cpu_ms_per_page": cpu,
        "db_cpu_ms_per_page": 2.0,
        "statements_per_page": 2.0,
        "rows": 100,
        "bytes": 40_000,
    }


def _result(pages: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "namespace": console.NAMESPACE,
        "plan": {"requests": 100},
        "sizes": [
            {
                "tasks": t,
                "table_rows": 2 * t,
                "history_entries": 8 * t,
                "seed_s": 1.0,
                "idle_statements_per_s": 1.0,
            }
            for t in sorted({p["tasks"] for p in pages})
        ],
        "pages": pages,
    }
    result["ratios"] = console.ratios(pages)
    result["target"] = console.target(result)
    return result


def test_ratios_divide_the_largest_sizes_p50_by_the_smallests() -> None:
    pages = [
        _page("first", 100_000, 20.0, 40.0, cpu=10.0),
        _page("first", 1_000_000, 25.0, 60.0, cpu=12.0),
        _page("task", 100_000, 10.0, 20.0),
    ]
    found = console.ratios(pages)
    assert found["first"] == {"wall": 1.25, "cpu": 1.2}
    assert "task" not in found  # one size only: no ratio


def test_target_is_met_when_every_tasks_page_is_fast_and_flat_at_the_largest_size() -> None:
    flat = _result(
        [
            _page("first", 100_000, 20.0, 40.0),
            _page("first", 1_000_000, 22.0, 150.0),
            _page("owner", 100_000, 10.0, 20.0),
            _page("owner", 1_000_000, 11.0, 30.0),
            # not a tasks page: neither its time nor its growth counts
            _page("namespaces", 100_000, 10.0, 20.0),
            _page("namespaces", 1_000_000, 90.0, 900.0),
        ]
    )
    assert flat["target"] == {
        "tasks": 1_000_000,
        "worst_p50_ms": 22.0,
        "worst_p99_ms": 150.0,
        "worst_p99_kind": "first",
        "worst_ratio": 1.1,
        "worst_ratio_kind": "first",
        "met": True,
    }
    slow = _result([_page("first", 100_000, 20.0, 40.0), _page("first", 1_000_000, 22.0, 250.0)])
    assert slow["target"]["met"] is False
    grows = _result([_page("deep", 100_000, 20.0, 40.0), _page("deep", 1_000_000, 30.0, 50.0)])
    assert grows["target"]["met"] is False and grows["target"]["worst_ratio"] == 1.5


def test_report_has_a_row_per_page_and_size_and_the_target_row() -> None:
    result = _result([_page("first", 100_000, 20.0, 40.0), _page("first", 1_000_000, 22.0, 90.0)])
    lines = console_table(result)
    rows = [line for line in lines if line.startswith("| tasks, first page")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    assert cells[:4] == ["tasks, first page", "1,000,000", "22.0", "90.0"]
    assert cells[-2:] == ["1.10", "1.00"]  # ratios on the largest size's row only
    assert [c.strip() for c in rows[0].strip("|").split("|")][-2:] == ["-", "-"]
    targets = targets_table({"points": [], "console": result})
    row = next(line for line in targets if "Console tasks page" in line)
    assert "1,000,000 tasks" in row and row.endswith("| yes |")
    assert "p99 90.0 ms (first; p50 at most 22.0 ms)" in row
    assert console_table(None) == []


def test_thread_cpu_ns_counts_this_processs_work_to_the_nanosecond() -> None:
    before = thread_cpu_ns(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    spent_ms = (thread_cpu_ns(os.getpid()) - before) / 1e6
    assert 45 <= spent_ms < 1000

"""The published benchmark run and the performance page that shows it.

docs/performance.md copies no figure of the published run: it includes the named
sections of bench/published/results.md (pymdownx.snippets), which
``python -m bench.report bench/published`` writes from results.json. These tests hold
the Markdown to the JSON and the page to the sections that exist.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.report import markdown

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "bench" / "published"
PAGE = ROOT / "docs" / "performance.md"
INCLUDE = re.compile(r'^--8<-- "bench/published/results\.md:([a-z-]+)"$', re.M)


def test_the_published_markdown_is_what_the_report_renders_from_the_published_run() -> None:
    # Fails after a change to the report's rendering until
    # `.venv/bin/python -m bench.report bench/published` is run.
    results = json.loads((PUBLISHED / "results.json").read_text())
    assert (PUBLISHED / "results.md").read_text() == markdown(results)


def test_the_page_includes_only_sections_the_published_run_has() -> None:
    published = (PUBLISHED / "results.md").read_text()
    included = INCLUDE.findall(PAGE.read_text())
    assert "targets" in included and "calls" in included
    for name in included:
        assert f"[start:{name}]" in published and f"[end:{name}]" in published, name


def test_a_part_the_run_left_out_gives_no_section() -> None:
    results = json.loads((PUBLISHED / "results.json").read_text())
    for part in ("cpu_per_op", "sessions_scale", "console", "comparisons"):
        results.pop(part, None)
    rendered = markdown(results)
    for name in ("cpu-per-op", "sessions", "console", "side-by-side"):
        assert f"[start:{name}]" not in rendered
    # Every section that is there opens and closes, in order, once.
    starts = re.findall(r"\[start:([a-z-]+)\]", rendered)
    ends = re.findall(r"\[end:([a-z-]+)\]", rendered)
    assert starts == ends and len(set(starts)) == len(starts)
    assert starts[:2] == ["run", "calls"]

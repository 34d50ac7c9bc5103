"""The console's "fences over time" chart: bars, endings, markers, escaping (no server)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

from leasekeeper import HistoryEntry, HistoryKind
from leasekeeper_server.console import chart

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
SVG = "{http://www.w3.org/2000/svg}"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def entry(sequence: int, seconds: float, kind: HistoryKind, **fields: object) -> HistoryEntry:
    return HistoryEntry(sequence=sequence, event_time=at(seconds), kind=kind, **fields)  # type: ignore[arg-type]


def endings(spans: chart.Spans) -> list[tuple[int, str, float, float]]:
    return [
        (bar.fence, bar.ending, (bar.start - T0).total_seconds(), (bar.end - T0).total_seconds())
        for bar in spans.bars
    ]


def test_each_grant_is_a_bar_ended_by_what_ended_it() -> None:
    entries = [
        entry(1, 0, HistoryKind.GRANTED, fence=1, owner_id="a"),
        entry(2, 5, HistoryKind.CHECKPOINT_SAVED, fence=1, checkpoint_version=1),
        entry(3, 10, HistoryKind.EXPIRED, fence=1, reason="LEASE_EXPIRED"),
        entry(4, 12, HistoryKind.GRANTED, fence=2, owner_id="b"),
        entry(5, 20, HistoryKind.GRANTED, fence=3, owner_id="b"),  # b again: superseded
        entry(6, 25, HistoryKind.REVOKED, fence=3, reason="bad host"),
        entry(7, 30, HistoryKind.GRANTED, fence=4, owner_id="c"),
        entry(8, 40, HistoryKind.RELEASED, fence=4),
        entry(9, 50, HistoryKind.GRANTED, fence=5, owner_id="d"),
        entry(10, 55, HistoryKind.EXPIRED, fence=5, reason="RUNTIME_EXCEEDED"),
        entry(11, 60, HistoryKind.GRANTED, fence=6, owner_id="e"),
        entry(12, 70, HistoryKind.COMPLETED, fence=6),
    ]
    spans = chart.spans(entries, now=at(100))
    assert endings(spans) == [
        (1, "expired", 0, 10),
        (2, "superseded", 12, 20),
        (3, "revoked", 20, 25),
        (4, "released", 30, 40),
        (5, "runtime_exceeded", 50, 55),
        (6, "completed", 60, 70),
    ]
    labels = [(m.fence, m.label) for m in spans.markers]
    assert labels == [
        (1, "LEASE_EXPIRED"),
        (2, "LEASE_SUPERSEDED"),
        (3, "revoked: bad host"),
        (5, "RUNTIME_EXCEEDED"),
    ]


def test_a_lease_still_held_runs_to_now_and_is_no_loss() -> None:
    entries = [entry(1, 0, HistoryKind.GRANTED, fence=7, owner_id="w")]
    spans = chart.spans(entries, now=at(42))
    assert endings(spans) == [(7, "held", 0, 42)]
    assert spans.markers == []
    # Without a database time the bar ends at the last time in the history.
    assert endings(chart.spans(entries, now=None)) == [(7, "held", 0, 0)]


def test_cancel_ends_the_held_lease_and_refusals_are_markers() -> None:
    entries = [
        entry(1, 0, HistoryKind.GRANTED, fence=1, owner_id="a"),
        entry(2, 3, HistoryKind.CANCELLED, fence=1, reason="customer left"),
        entry(
            3, 4, HistoryKind.FENCE_REFUSED, fence=1, reason="TASK_CANCELLED", method="BeginEffect"
        ),
    ]
    spans = chart.spans(entries, now=at(5))
    assert endings(spans) == [(1, "cancelled", 0, 3)]
    assert [(m.label, m.refused) for m in spans.markers] == [
        ("cancelled: customer left", False),
        ("refused TASK_CANCELLED at BeginEffect", True),
    ]


def test_only_the_newest_fences_are_drawn() -> None:
    entries = []
    for fence in range(1, chart.MAX_ROWS + 11):
        entries.append(entry(2 * fence, fence, HistoryKind.GRANTED, fence=fence, owner_id="w"))
        entries.append(entry(2 * fence + 1, fence + 0.5, HistoryKind.RELEASED, fence=fence))
    spans = chart.spans(entries, now=None)
    assert spans.fences_left_out == 10
    assert [bar.fence for bar in spans.bars] == list(range(11, chart.MAX_ROWS + 11))


def test_the_svg_has_a_time_axis_a_row_per_fence_and_coloured_bars() -> None:
    entries = [
        entry(1, 0, HistoryKind.GRANTED, fence=1, owner_id="a"),
        entry(2, 30, HistoryKind.REVOKED, fence=1, reason="drain"),
        entry(3, 31, HistoryKind.GRANTED, fence=2, owner_id="b"),
    ]
    svg, spans = chart.fence_chart(entries, now=at(60))
    root = ET.fromstring(str(svg))  # well-formed XML
    assert root.tag == f"{SVG}svg"
    bars = root.findall(f"{SVG}rect")
    # The revoked lease was fine while held: its bar is the held colour, only its end is red.
    assert [(b.get("data-fence"), b.get("class"), b.get("fill")) for b in bars] == [
        ("1", "bar bar-revoked", chart.HELD_COLOUR),
        ("2", "bar bar-held", chart.HELD_COLOUR),
    ]
    [loss] = [g for g in root.iter(f"{SVG}g") if g.get("class") == "marker loss"]
    assert loss.find(f"{SVG}path") is not None
    assert loss.find(f"{SVG}path").get("fill") == chart.LOSS_COLOUR  # type: ignore[union-attr]
    assert (loss.find(f"{SVG}text").text or "") == "revoked: drain"  # type: ignore[union-attr]
    # Bar 1 spans half the time axis: 0 s to 30 s of 0 s to 60 s.
    width = chart.WIDTH - chart.LEFT - chart.RIGHT
    assert float(bars[0].get("x") or 0) == chart.LEFT
    assert abs(float(bars[0].get("width") or 0) - width / 2) < 0.2
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "fence 1" in texts and "fence 2" in texts
    assert "revoked: drain" in texts
    ticks = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "tick"]
    assert ticks == ["03:04:05", "03:04:17", "03:04:29", "03:04:41", "03:04:53", "03:05:05"]
    assert any("2026-01-02 03:04:05.000Z to 2026-01-02 03:05:05.000Z" in t for t in texts)
    assert chart.legend(spans) == [("held", chart.HELD_COLOUR)]  # one key for one colour


def test_every_text_in_the_svg_is_escaped() -> None:
    hostile = '<script>alert(1)</script>"&'
    entries = [
        entry(1, 0, HistoryKind.GRANTED, fence=1, owner_id=hostile),
        entry(2, 1, HistoryKind.REVOKED, fence=1, reason=hostile),
        entry(3, 2, HistoryKind.FENCE_REFUSED, fence=1, reason=hostile, method=hostile),
    ]
    svg, _ = chart.fence_chart(entries, now=at(3))
    text = str(svg)
    assert "<script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&#34;&amp;" in text
    root = ET.fromstring(text)  # escaped well enough to stay one XML document
    titles = [t.text or "" for t in root.iter(f"{SVG}title")]
    assert any(hostile in title for title in titles)  # the text itself survives, as text


def test_no_grants_is_a_small_note() -> None:
    svg, spans = chart.fence_chart([entry(1, 0, HistoryKind.RETRIED, reason="x")], now=None)
    assert spans.bars == [] and spans.markers == []
    assert re.search(r"No grants in the history", str(svg))
    ET.fromstring(str(svg))


def test_released_and_completed_are_told_apart_and_the_legend_names_each_colour_once() -> None:
    entries = [
        entry(1, 0, HistoryKind.GRANTED, fence=1, owner_id="a"),
        entry(2, 5, HistoryKind.RELEASED, fence=1),
        entry(3, 6, HistoryKind.GRANTED, fence=2, owner_id="b"),
        entry(4, 8, HistoryKind.REVOKED, fence=2, reason="drain"),
        entry(5, 9, HistoryKind.GRANTED, fence=3, owner_id="c"),
        entry(6, 12, HistoryKind.COMPLETED, fence=3),
    ]
    svg, spans = chart.fence_chart(entries, now=at(20))
    fills = {b.get("class"): b.get("fill") for b in ET.fromstring(str(svg)).iter(f"{SVG}rect")}
    released, completed = fills["bar bar-released"], fills["bar bar-completed"]
    assert released == "#64748b" and completed == "#15803d"  # grey-blue and green

    def channels(colour: str) -> tuple[int, ...]:
        return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))

    distance = sum(abs(a - b) for a, b in zip(channels(released), channels(completed), strict=True))
    assert distance > 150  # not two shades of one green
    assert fills["bar bar-revoked"] == chart.HELD_COLOUR
    assert chart.legend(spans) == [
        ("held", chart.HELD_COLOUR),
        ("released", released),
        ("completed", completed),
    ]
    colours = [colour for _label, colour in chart.ENDINGS.values()]
    # Every colour but the held one (shared by revoked) belongs to one ending only.
    assert len(set(colours)) == len(colours) - 1

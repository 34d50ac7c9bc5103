"""The "fences over time" chart of a task: an SVG drawn on the server from its history.

Pure: history entries in, SVG text out (no I/O, no clock of its own). Each
grant is a bar on its fence's row, from the grant to the entry that ended it
(a release, completion, failure, expiry, revoke, cancel, or the next grant
while it was still held: superseded); a lease still held runs to ``now``.
Bars are coloured by how they ended (``ENDINGS``; a revoked lease is drawn
as held: it was fine until it was revoked). Each loss (expired, runtime
exceeded, revoked, superseded, cancelled) is a red marker at the bar's end,
and each refused stale fence a cross, labelled with its reason. Every text
is escaped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from markupsafe import Markup

from leasekeeper import HistoryEntry, HistoryKind

# How a bar ended -> (legend label, colour). Colours pass WCAG contrast on white. A lease was
# fine while it was held: a bar whose ending was a revoke is drawn in the colour of a held
# lease, and only its end, the loss marker, is red ("drawn as held" below).
HELD_COLOUR = "#2563eb"
ENDINGS: dict[str, tuple[str, str]] = {
    "held": ("held", HELD_COLOUR),
    "released": ("released", "#64748b"),
    "completed": ("completed", "#15803d"),
    "failed": ("failed", "#9f1239"),
    "expired": ("expired", "#b45309"),
    "runtime_exceeded": ("runtime exceeded", "#92400e"),
    "revoked": ("revoked", HELD_COLOUR),
    "superseded": ("superseded", "#7c3aed"),
    "cancelled": ("cancelled", "#1f2937"),
    "unknown": ("end not in the history", "#9ca3af"),
}
LOSS_COLOUR = "#dc2626"  # the marker at the end of a lost lease
# Endings that are losses: the holder did not end its lease itself.
LOSSES = frozenset({"expired", "runtime_exceeded", "revoked", "superseded", "cancelled"})
# History kinds that end the open lease, and the ending they give it.
_ENDING_OF: dict[HistoryKind, str] = {
    HistoryKind.RELEASED: "released",
    HistoryKind.COMPLETED: "completed",
    HistoryKind.FAILED: "failed",
    HistoryKind.REVOKED: "revoked",
    HistoryKind.CANCELLED: "cancelled",
}

MAX_ROWS = 30  # fences drawn; older ones are left out (said under the chart)
WIDTH = 1080
LEFT = 78  # room for "fence 123456"
RIGHT = 16
TOP = 10
ROW = 32  # a bar, and under it the labels of its markers
BAR = 14
LABEL_PX_PER_CHAR = 5.6  # the width of a 10 px label, estimated, to keep labels apart
AXIS = 34  # the time axis under the rows
TICKS = 5
LABEL_CHARS = 48


@dataclasses.dataclass(frozen=True, slots=True)
class Bar:
    """One grant: a fence held from ``start`` to ``end``, and how it ended."""

    fence: int
    owner_id: str
    start: datetime
    end: datetime
    ending: str
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Marker:
    """A loss at the end of a bar, or a stale fence refused, with its label."""

    fence: int
    time: datetime
    label: str
    refused: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Spans:
    """What the chart draws: bars, markers, and whether older fences were left out."""

    bars: list[Bar]
    markers: list[Marker]
    fences_left_out: int = 0


def _loss_label(bar: Bar) -> str:
    names = {
        "expired": "LEASE_EXPIRED",
        "runtime_exceeded": "RUNTIME_EXCEEDED",
        "superseded": "LEASE_SUPERSEDED",
    }
    if bar.ending in ("revoked", "cancelled"):
        words = bar.reason or "no reason given"
        return f"{bar.ending}: {words}"
    return names.get(bar.ending, bar.ending)


def spans(entries: Iterable[HistoryEntry], now: datetime | None) -> Spans:
    """The bars and markers of a task's history (entries oldest first, by sequence).

    Args:
        entries: The task's history entries, in sequence order.
        now: The database time the task was read at, where a lease still
            held ends; None: the last time in the history.

    Returns:
        The bars of the newest ``MAX_ROWS`` fences, their loss markers, and
        the refusals of those fences.
    """
    bars: list[Bar] = []
    refusals: list[Marker] = []
    open_bar: Bar | None = None
    last_time: datetime | None = None

    def close(at: datetime, ending: str, reason: str = "") -> None:
        nonlocal open_bar
        if open_bar is not None:
            end = max(at, open_bar.start)
            bars.append(dataclasses.replace(open_bar, end=end, ending=ending, reason=reason))
            open_bar = None

    for entry in entries:
        at = entry.event_time
        if at is None:
            continue
        last_time = at if last_time is None else max(last_time, at)
        kind = entry.kind
        if kind is HistoryKind.GRANTED:
            if open_bar is not None and open_bar.fence == entry.fence:
                continue  # the same lease written again (a new owner id on it): one bar
            close(at, "superseded")
            open_bar = Bar(entry.fence, entry.owner_id, at, at, "held")
        elif kind is HistoryKind.EXPIRED:
            if open_bar is not None and open_bar.fence == entry.fence:
                ending = "runtime_exceeded" if entry.reason == "RUNTIME_EXCEEDED" else "expired"
                close(at, ending, entry.reason)
        elif kind in _ENDING_OF:
            if open_bar is not None and entry.fence in (0, open_bar.fence):
                close(at, _ENDING_OF[kind], entry.reason)
        elif kind is HistoryKind.FENCE_REFUSED:
            label = f"refused {entry.reason or 'stale fence'}"
            if entry.method:
                label += f" at {entry.method}"
            refusals.append(Marker(entry.fence, at, label, refused=True))
    if open_bar is not None:
        end = now if now is not None else (last_time or open_bar.start)
        bars.append(dataclasses.replace(open_bar, end=max(end, open_bar.start)))
    fences = sorted({bar.fence for bar in bars} | {marker.fence for marker in refusals})
    kept = set(fences[-MAX_ROWS:])
    bars = [bar for bar in bars if bar.fence in kept]
    markers = [Marker(bar.fence, bar.end, _loss_label(bar)) for bar in bars if bar.ending in LOSSES]
    markers += [marker for marker in refusals if marker.fence in kept]
    return Spans(bars, markers, len(fences) - len(kept))


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def _time_label(at: datetime, span: timedelta) -> str:
    if span >= timedelta(days=2):
        return at.strftime("%m-%d %H:%M")
    if span >= timedelta(minutes=5):
        return at.strftime("%H:%M")
    if span >= timedelta(seconds=10):
        return at.strftime("%H:%M:%S")
    if span >= timedelta(seconds=2):
        return at.strftime("%H:%M:%S.") + f"{at.microsecond // 100000}"
    return at.strftime("%H:%M:%S.") + f"{at.microsecond // 1000:03d}"


def _instant(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def render(chart: Spans, *, title: str = "Fences over time") -> Markup:
    """The SVG of ``chart``: rows by fence (newest at the bottom), a time axis, a legend.

    Returns:
        SVG markup, safe to put in a page as is (every text in it escaped).
    """
    fences = sorted({bar.fence for bar in chart.bars} | {m.fence for m in chart.markers})
    times = [bar.start for bar in chart.bars] + [bar.end for bar in chart.bars]
    times += [marker.time for marker in chart.markers]
    if not fences or not times:
        return Markup(
            '<svg class="fence-chart" role="img" xmlns="http://www.w3.org/2000/svg" '
            'width="{w}" height="40" viewBox="0 0 {w} 40"><title>{t}</title>'
            '<text x="8" y="24" class="chart-empty">No grants in the history.</text></svg>'
        ).format(w=WIDTH, t=title)
    first, last = min(times), max(times)
    span = last - first
    if span <= timedelta(0):
        span = timedelta(seconds=1)
        first -= span / 2
        last = first + span
    plot_w = WIDTH - LEFT - RIGHT
    row_of = {fence: index for index, fence in enumerate(fences)}
    height = TOP + ROW * len(fences) + AXIS

    def x(at: datetime) -> float:
        return round(LEFT + plot_w * ((at - first) / span), 1)

    def y(fence: int) -> int:
        return TOP + ROW * row_of[fence]

    parts: list[Markup] = [
        Markup(
            '<svg class="fence-chart" role="img" xmlns="http://www.w3.org/2000/svg" '
            'width="{w}" height="{h}" viewBox="0 0 {w} {h}"><title>{t}</title>'
        ).format(w=WIDTH, h=height, t=title)
    ]
    axis_y = TOP + ROW * len(fences) + 4
    for index in range(TICKS + 1):
        at = first + span * (index / TICKS)
        tick_x = x(at)
        anchor = "start" if index == 0 else "end" if index == TICKS else "middle"
        parts.append(
            Markup(
                '<line class="grid" x1="{x}" y1="{top}" x2="{x}" y2="{bottom}" '
                'stroke="#e5e7eb"/><text class="tick" x="{x}" y="{label_y}" '
                'text-anchor="{anchor}" font-size="11" fill="#4b5563">{label}</text>'
            ).format(
                x=tick_x,
                top=TOP,
                bottom=axis_y,
                label_y=axis_y + 14,
                anchor=anchor,
                label=_time_label(at, span),
            )
        )
    parts.append(
        Markup(
            '<line class="axis" x1="{l}" y1="{y}" x2="{r}" y2="{y}" stroke="#9ca3af"/>'
            '<text class="axis-note" x="{l}" y="{note_y}" font-size="10" fill="#6b7280">'
            "UTC, database clock: {first} to {last}</text>"
        ).format(
            l=LEFT,
            r=WIDTH - RIGHT,
            y=axis_y,
            note_y=axis_y + 28,
            first=_instant(first),
            last=_instant(last),
        )
    )
    for fence in fences:
        parts.append(
            Markup(
                '<text class="row-label" x="{x}" y="{y}" text-anchor="end" font-size="11" '
                'fill="#111827">fence {fence}</text>'
            ).format(x=LEFT - 6, y=y(fence) + BAR - 2, fence=fence)
        )
    for bar in chart.bars:
        label, colour = ENDINGS.get(bar.ending, ENDINGS["unknown"])
        start_x, end_x = x(bar.start), x(bar.end)
        tip = f"fence {bar.fence}, owner {bar.owner_id or '?'}: {_instant(bar.start)} to "
        tip += f"{_instant(bar.end)}, {label}"
        if bar.reason:
            tip += f" ({bar.reason})"
        parts.append(
            Markup(
                '<rect class="bar bar-{ending}" data-fence="{fence}" x="{x}" y="{y}" '
                'width="{w}" height="{h}" rx="2" fill="{colour}"><title>{tip}</title></rect>'
            ).format(
                ending=bar.ending,
                fence=bar.fence,
                x=start_x,
                y=y(bar.fence),
                w=max(round(end_x - start_x, 1), 2.0),
                h=BAR,
                colour=colour,
                tip=tip,
            )
        )
    taken: dict[int, list[tuple[float, float]]] = {}  # per row: the spans labels cover
    for marker in chart.markers:
        mx, my = x(marker.time), y(marker.fence)
        colour = "#111827" if marker.refused else LOSS_COLOUR
        shape = (
            Markup(
                '<path d="M{a} {b} L{c} {d} M{a} {d} L{c} {b}" stroke="{colour}" stroke-width="2"/>'
            ).format(a=mx - 4, b=my + 3, c=mx + 4, d=my + BAR - 3, colour=colour)
            if marker.refused
            else Markup(
                '<path d="M{mx} {top} L{right} {mid} L{mx} {bottom} L{left} {mid} Z" '
                'fill="{colour}" stroke="#fff" stroke-width="1"/>'
            ).format(
                mx=mx,
                top=my - 1,
                bottom=my + BAR + 1,
                mid=my + BAR / 2,
                left=mx - 5,
                right=mx + 5,
                colour=colour,
            )
        )
        label = _short(marker.label)
        width = len(label) * LABEL_PX_PER_CHAR
        row = taken.setdefault(marker.fence, [])
        # Right of the marker, or left of it near the right edge; else the other side; a
        # label that would cover another of its row is left out (the tooltip has it).
        sides = [("start", (mx, mx + width)), ("end", (mx - width, mx))]
        if mx > LEFT + plot_w * 0.6:
            sides.reverse()
        anchor, text_x = sides[0][0], mx
        for side, (left, right) in sides:
            inside = LEFT - 4 <= left and right <= WIDTH - RIGHT + 4
            if inside and not any(left < b + 6 and a < right + 6 for a, b in row):
                anchor = side
                row.append((left, right))
                break
        else:
            label = ""
        parts.append(
            Markup(
                '<g class="marker{kind}">{shape}<text x="{tx}" y="{ty}" font-size="10" '
                'text-anchor="{anchor}" fill="{colour}">{label}</text>'
                "<title>{full}</title></g>"
            ).format(
                kind=" refused" if marker.refused else " loss",
                shape=shape,
                tx=text_x,
                ty=my + BAR + 11,
                anchor=anchor,
                colour=colour,
                label=label,
                full=f"fence {marker.fence} at {_instant(marker.time)}: {marker.label}",
            )
        )
    parts.append(Markup("</svg>"))
    return Markup("").join(parts)


def legend(chart: Spans) -> list[tuple[str, str]]:
    """(label, colour) of each colour the chart's bars show, in ``ENDINGS`` order, once each.

    A colour shared by several endings is labelled by the first of them
    (a revoked lease's bar is "held").
    """
    shown = {ENDINGS.get(bar.ending, ENDINGS["unknown"])[1] for bar in chart.bars}
    keys: list[tuple[str, str]] = []
    for label, colour in ENDINGS.values():
        if colour in shown and all(colour != kept for _label, kept in keys):
            keys.append((label, colour))
    return keys


def fence_chart(entries: Sequence[HistoryEntry], now: datetime | None) -> tuple[Markup, Spans]:
    """The chart of a task's history: its SVG and what it shows (see :func:`spans`)."""
    chart = spans(entries, now)
    return render(chart), chart

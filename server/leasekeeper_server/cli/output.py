r"""How the ``leasekeeper`` command prints records: aligned tables, or JSON.

Records are plain dicts whose keys are the proto field names (or a database
table's column names). Their values are ``None``, ``str``, ``int``,
``float``, ``bool``, ``datetime`` (an instant), ``timedelta`` (a duration) or a
list of ``str``. Two renderings:

* text (the default): an aligned table, columns sized to their content;
  instants as ISO 8601 UTC to the millisecond (``2026-11-30T17:51:12.123Z``),
  durations in seconds (``12.3s``), an unset value as ``-``. Text shows what it
  holds: control and bidirectional control characters escaped (``\x07``,
  ``\u202e``: ids stored before the id rule refused them reach the tables as
  stored), line separators too (``\u2028``), text that is blank or starts or
  ends with whitespace quoted (``"   "``), text without a visible character
  quoted with its invisible characters escaped (``"\u200b"``), so no id shows
  blank, broken or reordered, or as its neighbour.
* JSON (``--json``): one object per line for lists; instants as ISO 8601
  with their offset, durations as float seconds.

Only the thin client's dependencies are used, so ``leases``, ``effects``,
``revoke`` and ``watch`` run without the server's extras.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf import descriptor, duration_pb2, timestamp_pb2
from google.protobuf.message import Message

from leasekeeper.ids import BIDI_CONTROLS, LINE_SEPARATORS, has_visible, is_invisible

Record = dict[str, Any]

# Bytes fields: digests print as hex, results as text (undecodable bytes escaped).
_HEX_FIELDS = frozenset({"request_digest"})
_GAP = "  "


def _enum_prefix(enum: Any) -> str:
    """``TaskState`` -> ``TASK_STATE_``: what every value name of the enum starts with."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"


def _field_value(field: Any, value: Any) -> Any:
    if field.type == descriptor.FieldDescriptor.TYPE_ENUM:
        enum = field.enum_type
        if value == 0:
            return None
        known = enum.values_by_number.get(value)
        return known.name.removeprefix(_enum_prefix(enum)) if known else str(value)
    if field.type == descriptor.FieldDescriptor.TYPE_BYTES:
        return value.hex() if field.name in _HEX_FIELDS else value.decode(errors="backslashreplace")
    if isinstance(value, timestamp_pb2.Timestamp):
        return value.ToDatetime(tzinfo=UTC)
    if isinstance(value, duration_pb2.Duration):
        return timedelta(microseconds=value.ToNanoseconds() / 1000)
    if isinstance(value, Message):
        return record_of(value)
    return value


def record_of(message: Message) -> Record:
    """A proto message as a record keyed by its field names.

    Enums lose their type prefix (``TASK_STATE_HELD`` -> ``"HELD"``; the
    UNSPECIFIED value -> None); an unset message field (an instant, a
    duration, a lease) is None; Timestamp -> ``datetime`` (UTC), Duration ->
    ``timedelta``; bytes -> hex for digests, text otherwise.
    """
    out: Record = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                out[field.name] = [_field_value(field, item) for item in value]
                continue
            if not message.HasField(field.name):
                out[field.name] = None
                continue
        out[field.name] = _field_value(field, value)
    return out


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    raise TypeError(f"cannot print {type(value).__name__} as JSON")


def to_json(record: Mapping[str, Any], indent: int | None = None) -> str:
    """One record as JSON text (instants ISO 8601, durations float seconds)."""
    return json.dumps(record, default=_json_default, indent=indent, ensure_ascii=False)


def _escaped(ch: str, blank: bool = False) -> str:
    r"""``ch`` as a cell shows it: escaped when it would hide or break something.

    A control character as ``\x07``; a bidirectional control or line separator
    as ``\u202e``; in ``blank`` text (no visible character), every invisible
    character but the space too (``\u200b``); else ``ch``.
    """
    if unicodedata.category(ch) == "Cc":
        return f"\\x{ord(ch):02x}"
    if ch in BIDI_CONTROLS or ch in LINE_SEPARATORS or (blank and ch != " " and is_invisible(ch)):
        return f"\\u{ord(ch):04x}"
    return ch


def _printable(text: str) -> str:
    r"""Text as a cell shows it: on one line, aligned, in its stored order, never blank.

    Control characters are escaped, so the cell stays on its line; bidirectional
    controls too, which would reorder what is shown around them invisibly; text
    that is blank or starts or ends with whitespace is quoted, so that ``"   "``
    shows and ``"a "`` does not read as ``a``; text without a visible character
    is quoted with its invisible characters escaped (``"\u200b"``).
    """
    blank = not has_visible(text)
    shown = "".join(_escaped(ch, blank) for ch in text)
    return f'"{shown}"' if blank or shown != shown.strip() else shown


def cell(value: object) -> str:
    """One value as table text: ``-`` when unset, ``12.3s``, ``...T17:51:12.123Z``."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    if isinstance(value, timedelta):
        return f"{value.total_seconds():.1f}s"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ",".join(_printable(str(item)) for item in value) or "-"
    return _printable(str(value))


def table(records: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """An aligned table: a header of the column names upper-cased, then one line per record.

    Columns are as wide as their widest cell; numbers are right-aligned.
    """
    rows = [[cell(record.get(name)) for name in columns] for record in records]
    header = [name.upper() for name in columns]
    widths = [max(len(text) for text in column) for column in zip(header, *rows, strict=False)]
    numeric = [
        bool(rows) and all(row[i].lstrip("-").replace(".", "", 1).isdigit() for row in rows)
        for i in range(len(columns))
    ]
    lines = []
    for row in [header, *rows]:
        texts = [
            text.rjust(width) if is_number else text.ljust(width)
            for text, width, is_number in zip(row, widths, numeric, strict=True)
        ]
        lines.append(_GAP.join(texts).rstrip())
    return "\n".join(lines)


def details(record: Mapping[str, Any], fields: Sequence[str] | None = None) -> str:
    """One record as ``name  value`` lines, names aligned (for a single lease or token)."""
    names = list(fields if fields is not None else record)
    width = max((len(name) for name in names), default=0)
    return "\n".join(f"{name.ljust(width)}{_GAP}{cell(record.get(name))}" for name in names)

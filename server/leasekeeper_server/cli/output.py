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
* JSON (``--json``): JSON Lines, one object per line and nothing else on
  standard output, for every command (a single result is one line);
  instants as ISO 8601 with their offset, durations as float seconds.

A task and a history entry are shown in text with a few values joined
(:func:`task_shown`, :func:`history_shown`): attempts as ``2/5`` against their
limit, the checkpoint as its version and size, an entry's kind-specific fields
as ``name=value`` details. JSON keeps every field as the proto names it.

A command that changed nothing (a revoke of a task without a live lease, a
second cancel, limits set to the values they have, a token revoked again)
prints its result as a change would, says so in one line on standard error
(:func:`unchanged`) and exits ``EXIT_UNCHANGED``; the exit codes are listed
in ``cli/main.py``.

Only the thin client's dependencies are used, so the commands that call a
server run without the server's extras.
"""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf import descriptor, duration_pb2, timestamp_pb2
from google.protobuf.message import Message

from leasekeeper.ids import BIDI_CONTROLS, LINE_SEPARATORS, has_visible, is_invisible

Record = dict[str, Any]

# The command's exit codes (cli/main.py's docstring and `leasekeeper --help` say when).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNCHANGED = 3

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


def to_json(record: Mapping[str, Any]) -> str:
    r"""One record as one line of JSON (instants ISO 8601, durations float seconds).

    Never indented: ``--json`` prints JSON Lines. A newline inside a string
    is escaped (``\n``); other characters are kept as they are
    (``ensure_ascii`` off), U+2028 too: readers split lines at ``\n`` only.
    """
    return json.dumps(record, default=_json_default, ensure_ascii=False)


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


def detail(value: object) -> str:
    r"""One value of a ``name=value`` detail, as :func:`cell` shows it and quoted when needed.

    Text holding a space, a quote or ``=`` is quoted (``reason="stuck worker"``,
    inner quotes as ``\"``), so the details of one line stay apart.
    """
    if not isinstance(value, str) or value == "":
        return cell(value)
    blank = not has_visible(value)
    shown = "".join(_escaped(ch, blank) for ch in value)
    if blank or any(ch.isspace() or ch in '"=' for ch in shown):
        return '"' + shown.replace('"', '\\"') + '"'
    return shown


def attempts_text(lease: Mapping[str, Any]) -> str:
    """``attempts/max_attempts`` (``2/5``) when the grant carries a limit, else the count."""
    attempts, limit = lease.get("attempts") or 0, lease.get("max_attempts") or 0
    return f"{attempts}/{limit}" if limit else str(attempts)


def checkpoint_text(
    lease: Mapping[str, Any], checkpoint: Mapping[str, Any] | None = None, table: bool = False
) -> str:
    """The stored checkpoint in one line; ``""`` when there is none (shown ``-``).

    ``version 3, 1024 bytes``, from the lease; with the checkpoint itself
    (GetLease's, its ``size`` in bytes added) also its content type, fence
    and write time: ``version 3, 1024 bytes, application/json, fence 2,
    2026-11-30T17:51:12.123Z``; for a table, without a space: ``v3:1024B``.
    """
    version, size = lease.get("checkpoint_version") or 0, lease.get("checkpoint_size") or 0
    if checkpoint:
        version, size = checkpoint.get("version") or version, checkpoint.get("size", size)
    if not version:
        return ""
    if table:
        return f"v{version}:{size}B"
    parts = [f"version {version}", f"{size} bytes"]
    if checkpoint:
        if checkpoint.get("content_type"):
            parts.append(str(checkpoint["content_type"]))
        if checkpoint.get("fence"):
            parts.append(f"fence {checkpoint['fence']}")
        if checkpoint.get("write_time") is not None:
            parts.append(cell(checkpoint["write_time"]))
    return ", ".join(parts)


def task_shown(
    lease: Mapping[str, Any], checkpoint: Mapping[str, Any] | None = None, table: bool = False
) -> Record:
    """A lease record as task details (or, with ``table``, a table row) show it.

    ``attempts`` becomes :func:`attempts_text`; ``checkpoint`` is
    :func:`checkpoint_text` of the lease and, when given, the checkpoint
    itself (GetLease's); the other fields are kept.
    """
    return {
        **lease,
        "attempts": attempts_text(lease),
        "checkpoint": checkpoint_text(lease, checkpoint, table),
    }


# The fields each history kind uses beyond sequence, time, fence, owner and attempt
# (HistoryEntry in the proto), with the label each is shown under.
_HISTORY_DETAILS: dict[str, tuple[tuple[str, str], ...]] = {
    "GRANTED": (),
    "RELEASED": (),
    "COMPLETED": (),
    "EXPIRED": (("reason", "reason"),),
    "REVOKED": (("reason", "reason"),),
    "FAILED": (("reason", "reason"),),
    "CANCELLED": (("reason", "reason"),),
    "QUARANTINED": (("reason", "reason"),),
    "RETRIED": (("reason", "reason"),),
    "CHECKPOINT_SAVED": (("checkpoint_version", "version"), ("checkpoint_size", "size")),
    "EFFECT_RESERVED": (("effect_key", "effect_key"),),
    "EFFECT_COMPLETED": (
        ("effect_key", "effect_key"),
        ("effect_outcome", "outcome"),
        ("external_operation_id", "external_operation_id"),
    ),
    "FENCE_REFUSED": (("reason", "reason"), ("method", "method")),
}
# A kind this command does not know (a newer server): every detail field that is set.
_EVERY_DETAIL = tuple(dict.fromkeys(pair for pairs in _HISTORY_DETAILS.values() for pair in pairs))


def history_details(entry: Mapping[str, Any]) -> str:
    """The fields an entry's kind uses, as ``name=value`` details (unset text left out).

    ``version=3 size=1024B``; ``effect_key=k outcome=SUCCEEDED
    external_operation_id=op-1``; ``reason="stuck worker"``;
    ``reason=LEASE_SUPERSEDED method=ValidateFence``.
    """
    known = _HISTORY_DETAILS.get(str(entry.get("kind")))
    shown = []
    for field, label in _EVERY_DETAIL if known is None else known:
        value = entry.get(field)
        if value is None or value == "" or (known is None and value == 0):
            continue
        text = f"{value}B" if field == "checkpoint_size" else detail(value)
        shown.append(f"{label}={text}")
    return " ".join(shown)


def history_shown(entry: Mapping[str, Any]) -> Record:
    """A history entry record as the history table shows it.

    A fence or attempt of 0 (the kind has none) is unset; ``details`` is
    :func:`history_details`.
    """
    return {
        **entry,
        "fence": entry.get("fence") or None,
        "attempt": entry.get("attempt") or None,
        "details": history_details(entry),
    }


def quoted(text: str) -> str:
    r"""Text in double quotes, as :func:`cell` escapes it (``"billing"``, ``"a\"b"``)."""
    blank = not has_visible(text)
    return '"' + "".join("\\" + ch if ch in '"\\' else _escaped(ch, blank) for ch in text) + '"'


def unchanged(why: str) -> int:
    """Says on standard error that the command changed nothing, and why; returns its exit code.

    ``leasekeeper: nothing changed: WHY``; the result itself goes to
    standard output as for a change (``--json``: its one object).
    """
    print(f"leasekeeper: nothing changed: {why}", file=sys.stderr)
    return EXIT_UNCHANGED

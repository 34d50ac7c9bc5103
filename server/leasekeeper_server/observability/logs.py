"""Logging set-up: text or JSON lines for the service's log, JSON lines for the audit log.

``LEASEKEEPER_LOG_FORMAT=json`` writes one JSON object per record with
``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger`` and
``message``, plus the task's fields when a record carries them in
``extra=`` (``namespace``, ``task_id``, ``fence``, ``owner_id``,
``expire_time``, ...): the same names as the spans' ``leasekeeper.*``
attributes and the proto's fields. ``text`` (the default) writes
``time level logger: message``.

The audit logger (``leasekeeper.audit``, see ``audit.py``) always writes JSON
lines, at INFO whatever ``log_level`` is: to the file ``audit_log`` when set
(reopened when rotated away), else to standard error.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
import warnings
from pathlib import Path
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

from leasekeeper_server.observability.audit import AUDIT_LOGGER, AuditFormatter

LogFormat = Literal["text", "json"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def json_formatter() -> logging.Formatter:
    """A formatter of one JSON object per record: time, level, logger, message, extras."""
    return JsonFormatter(
        "%(levelname)s %(name)s %(message)s",
        rename_fields={"levelname": "level", "name": "logger"},
        timestamp="time",
        json_ensure_ascii=False,
    )


def configure(
    level: str = "INFO", log_format: LogFormat = "text", audit_log: Path | None = None
) -> None:
    """Configures the process's logging (the ``serve`` command calls this once).

    Replaces the root logger's handlers with one on standard error, in
    ``log_format``; gives the audit logger its own JSON handler.

    Args:
        level: The root level name (DEBUG, INFO, WARNING, ...).
        log_format: ``text`` or ``json``.
        audit_log: The audit log's file (appended to); None for standard error.

    Raises:
        ValueError: an unknown level or format.
        OSError: the audit log file cannot be opened.
    """
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        json_formatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())

    audit = logging.getLogger(AUDIT_LOGGER)
    for old in list(audit.handlers):
        audit.removeHandler(old)
        old.close()
    audit_handler: logging.Handler = (
        logging.handlers.WatchedFileHandler(audit_log, encoding="utf-8")
        if audit_log is not None
        else logging.StreamHandler(sys.stderr)
    )
    audit_handler.setFormatter(AuditFormatter())
    audit.addHandler(audit_handler)
    audit.setLevel(logging.INFO)
    audit.propagate = False

    # pgserver narrates every pg_ctl call at INFO; its warnings and errors still show.
    logging.getLogger("pgserver").setLevel(max(logging.WARNING, root.level))
    # platformdirs warns when XDG_RUNTIME_DIR is unset (containers); pgserver asks it anyway.
    warnings.filterwarnings("ignore", module="platformdirs")

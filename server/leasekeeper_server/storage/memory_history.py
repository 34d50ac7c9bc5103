"""The in-memory task history: the rows of ``leasekeeper_task_history``, one sequence for all.

The entries are those the triggers of ``migrations/0008_runs.sql`` write
(grants, endings, checkpoints, effects) and ``record_refusal``'s; the
in-memory store and ledger write them (``MemoryStore.write_history``) when
they commit a change, and ``MemoryStore.list_history`` and
``MemoryStore.namespace_stats`` read them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from leasekeeper_server.core.model import HistoryEntry, TaskKey


class MemoryHistory:
    """Every task's history entries, numbered by one sequence for the whole store."""

    def __init__(self) -> None:
        self._entries: dict[TaskKey, list[HistoryEntry]] = {}
        self._sequence = 0

    def write(self, key: TaskKey, event_time: datetime, **fields: Any) -> None:
        """Appends one entry to the task's history (a row of ``leasekeeper_task_history``).

        ``fields`` are HistoryEntry's (``kind`` at least); those left out are
        0 or empty, as the table's defaults. The sequence is the store's next.
        """
        self._sequence += 1
        entry = {
            "fence": 0,
            "owner_id": "",
            "attempt": 0,
            "checkpoint_version": 0,
            "checkpoint_size": 0,
            "effect_key": "",
            "effect_outcome": "",
            "external_operation_id": "",
            "reason": "",
            "method": "",
            **fields,
        }
        self._entries.setdefault(key, []).append(
            HistoryEntry(sequence=self._sequence, event_time=event_time, **entry)
        )

    def page(self, key: TaskKey, after_sequence: int, limit: int) -> list[HistoryEntry]:
        """The task's entries after ``after_sequence``, oldest first, at most ``limit``."""
        entries = self._entries.get(key, [])
        return [entry for entry in entries if entry.sequence > after_sequence][:limit]

    def of(self, key: TaskKey) -> list[HistoryEntry]:
        """Every entry of the task, oldest first."""
        return list(self._entries.get(key, []))

    def since(self, namespace: str, after: datetime) -> list[HistoryEntry]:
        """The namespace's entries whose event_time is after ``after``, in sequence order."""
        return sorted(
            (
                entry
                for key, entries in self._entries.items()
                if key.namespace == namespace
                for entry in entries
                if entry.event_time > after
            ),
            key=lambda entry: entry.sequence,
        )

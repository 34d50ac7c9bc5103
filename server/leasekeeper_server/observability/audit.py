"""The audit log: one JSON record per grant, release, loss, expiry, revoke, cancel and retry.

Records go to the logger ``leasekeeper.audit`` at INFO, always as JSON lines
(``logs.configure`` gives it its own handler: the file ``audit_log``, or
standard error). Each record has ``event`` and the task's fields:

=========  ===================================================================
event      fields (besides time, level, logger, message)
=========  ===================================================================
grant      namespace, task_id, owner_id, fence, expire_time, principal
release    namespace, task_id, owner_id, fence, complete, fail, fail_reason
           (the owner's, with fail only), principal
loss       namespace, task_id, owner_id, fence, reason, rpc (Renew, Release,
           Heartbeat, SaveCheckpoint: the call that learned of the loss),
           principal
expired    namespace, task_id, owner_id, fence, expire_time (once per expiry,
           whoever announced it: the sweeper or the change that ended it)
revoke     namespace, task_id, fence, revoked, reason (the operator's),
           principal
cancel     namespace, task_id, fence (the task's last), cancelled (false:
           it was cancelled already, nothing changed), reason (the
           operator's), principal
retry      namespace, task_id, fence (the task's last), reason (the
           operator's), principal
=========  ===================================================================

``principal`` is the caller's token name when the server requires tokens,
else absent. ``expire_time`` is RFC 3339 text on the database clock.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

AUDIT_LOGGER = "leasekeeper.audit"

# The record attribute that carries an audit record's fields.
_FIELDS = "audit_fields"


class AuditFormatter(logging.Formatter):
    """One JSON object per audit record: level, logger, message, the record's fields, time.

    The same object the service's JSON log formatter writes for a record
    with these fields as extras, built with one ``json.dumps``: a record is
    written for every grant, so the general formatter's per-record
    introspection of the record's attributes is a cost worth not paying.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON (``time``: RFC 3339, UTC, microseconds)."""
        line: dict[str, Any] = {
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, _FIELDS, {}))
        line["time"] = datetime.fromtimestamp(record.created, UTC).isoformat()
        return json.dumps(line, ensure_ascii=False, default=str)


class Audit:
    """Writes audit records; each method is cheap when the audit logger is off.

    Args:
        logger: Where records go (default: ``leasekeeper.audit``).
    """

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger if logger is not None else logging.getLogger(AUDIT_LOGGER)

    @property
    def enabled(self) -> bool:
        """True when records would be written (the logger is enabled for INFO)."""
        return self._log.isEnabledFor(logging.INFO)

    def _write(self, event: str, message: str, fields: dict[str, Any]) -> None:
        fields = {k: v for k, v in fields.items() if v is not None}
        fields["event"] = event
        self._log.info(message, extra={_FIELDS: fields})

    def grant(
        self,
        namespace: str,
        task_id: str,
        owner_id: str,
        fence: int,
        expire_time: str,
        principal: str | None = None,
    ) -> None:
        """Records a granted lease (a Claim answered acquired=true)."""
        self._write(
            "grant",
            f"grant {namespace}/{task_id} fence={fence} owner_id={owner_id}",
            {
                "namespace": namespace,
                "task_id": task_id,
                "owner_id": owner_id,
                "fence": fence,
                "expire_time": expire_time,
                "principal": principal,
            },
        )

    def release(
        self,
        namespace: str,
        task_id: str,
        owner_id: str,
        fence: int,
        complete: bool,
        principal: str | None = None,
        *,
        fail: bool = False,
        fail_reason: str | None = None,
    ) -> None:
        """Records a release of a lease by its owner: plain, completing or failing the task."""
        self._write(
            "release",
            f"release {namespace}/{task_id} fence={fence} complete={complete} fail={fail}",
            {
                "namespace": namespace,
                "task_id": task_id,
                "owner_id": owner_id,
                "fence": fence,
                "complete": complete,
                "fail": fail,
                "fail_reason": fail_reason,
                "principal": principal,
            },
        )

    def loss(
        self,
        rpc: str,
        namespace: str,
        task_id: str,
        owner_id: str,
        fence: int,
        reason: str,
        principal: str | None = None,
    ) -> None:
        """Records a holder told its lease is lost (Renew, Release, Heartbeat ABORTED)."""
        self._write(
            "loss",
            f"loss {namespace}/{task_id} fence={fence} reason={reason} rpc={rpc}",
            {
                "namespace": namespace,
                "task_id": task_id,
                "owner_id": owner_id,
                "fence": fence,
                "reason": reason,
                "rpc": rpc,
                "principal": principal,
            },
        )

    def expired(
        self,
        namespace: str,
        task_id: str,
        owner_id: str,
        fence: int,
        expire_time: datetime | str,
    ) -> None:
        """Records an announced expiry (its expire_time passed unrenewed), once per lease.

        Args:
            namespace: The task's namespace.
            task_id: The task.
            owner_id: The lease's owner.
            fence: The lease's fence.
            expire_time: When the lease ended (database clock); a datetime is
                written as ISO 8601 text.
        """
        when = expire_time.isoformat() if isinstance(expire_time, datetime) else expire_time
        self._write(
            "expired",
            f"expired {namespace}/{task_id} fence={fence}",
            {
                "namespace": namespace,
                "task_id": task_id,
                "owner_id": owner_id,
                "fence": fence,
                "expire_time": when,
            },
        )

    def revoke(
        self,
        namespace: str,
        task_id: str,
        fence: int,
        revoked: bool,
        reason: str,
        principal: str | None = None,
    ) -> None:
        """Records a Revoke call answered OK (``revoked`` says whether a lease ended)."""
        self._write(
            "revoke",
            f"revoke {namespace}/{task_id} fence={fence} revoked={revoked}",
            {
                "namespace": namespace,
                "task_id": task_id,
                "fence": fence,
                "revoked": revoked,
                "reason": reason,
                "principal": principal,
            },
        )

    def cancel(
        self,
        namespace: str,
        task_id: str,
        fence: int,
        cancelled: bool,
        reason: str,
        principal: str | None = None,
    ) -> None:
        """Records a Cancel call answered OK: the task is CANCELLED (``fence``: its last).

        ``cancelled`` False: it was cancelled already, and this call changed
        nothing (the task keeps the first cancel's reason).
        """
        self._write(
            "cancel",
            f"cancel {namespace}/{task_id} fence={fence} cancelled={cancelled}",
            {
                "namespace": namespace,
                "task_id": task_id,
                "fence": fence,
                "cancelled": cancelled,
                "reason": reason,
                "principal": principal,
            },
        )

    def retry(
        self,
        namespace: str,
        task_id: str,
        fence: int,
        reason: str,
        principal: str | None = None,
    ) -> None:
        """Records a Retry call answered OK: the quarantined task is FREE (``fence``: its last)."""
        self._write(
            "retry",
            f"retry {namespace}/{task_id} fence={fence}",
            {
                "namespace": namespace,
                "task_id": task_id,
                "fence": fence,
                "reason": reason,
                "principal": principal,
            },
        )

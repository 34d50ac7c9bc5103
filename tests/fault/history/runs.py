"""The history checker's rules for runs: checkpoints, ended tasks, attempts, the task history.

Properties 6 to 9 of :mod:`tests.fault.history.checker`, which states them and
calls :func:`check_runs` with the same plain-data inputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]
# Row states after which a task never changes again.
TASK_ENDED_STATES = frozenset({"completed", "failed", "cancelled"})
HISTORY_KEPT_PER_TASK = 1000  # the server's default history_max_per_task


@dataclasses.dataclass
class CheckpointWrite:
    """One checkpoint write as the database recorded it (the version that carries it)."""

    task: str
    version: int
    fence: int
    write_us: int
    data: str | None
    row: Row
    before: Row | None  # the task's previous version


def _checkpoint_of(row: Row) -> tuple[Any, Any, Any, Any]:
    """A row's checkpoint: ``(version, fence, instant, data)``; Nones when it has none."""
    return (
        row.get("checkpoint_version"),
        row.get("checkpoint_fence"),
        row.get("checkpoint_us"),
        row.get("checkpoint_data"),
    )


def checkpoint_writes(versions: Iterable[Row], out: list[str]) -> dict[str, list[CheckpointWrite]]:
    """Per task, every checkpoint write in the order the database made them.

    A checkpoint that goes away (nothing may clear one) is reported in ``out``.
    """
    writes: dict[str, list[CheckpointWrite]] = defaultdict(list)
    previous: dict[str, Row] = {}
    for v in versions:
        task = v["task_id"]
        before = previous.get(task)
        previous[task] = v
        stored = _checkpoint_of(v)
        if before is not None and stored == _checkpoint_of(before):
            continue
        if stored[0] is None:
            if before is not None and before.get("checkpoint_version") is not None:
                out.append(
                    f"checkpoint: {task}'s checkpoint v{before['checkpoint_version']} was cleared"
                )
            continue
        version, fence, write_us, data = stored
        writes[task].append(CheckpointWrite(task, version, fence, write_us, data, v, before))
    return writes


def check_runs(
    events: Sequence[Row],
    versions: Sequence[Row],
    tasks: Sequence[Row],
    task_history: Sequence[Row] | None,
    out: list[str],
    counts: Counter[str],
) -> None:
    """Checks properties 6 to 9; each violation is appended to ``out``.

    ``task_history`` None: property 9 is not checked.
    """
    writes = checkpoint_writes(versions, out)
    _check_checkpoint_writes(writes, out, counts)
    _check_checkpoints_handed_out(events, versions, tasks, writes, out, counts)
    _check_checkpoints_acknowledged(events, tasks, writes, out, counts)
    _check_terminal(events, versions, tasks, out, counts)
    _check_attempts(events, versions, out, counts)
    if task_history is not None:
        _check_task_history(task_history, versions, writes, out, counts)


def _check_checkpoint_writes(
    writes: Mapping[str, list[CheckpointWrite]], out: list[str], counts: Counter[str]
) -> None:
    for task, task_writes in writes.items():
        last = 0
        for w in task_writes:
            counts["checkpoints.written"] += 1
            what = f"{task} v{w.version} by fence {w.fence} at {w.write_us}"
            if w.version <= last:
                out.append(f"checkpoint: {what} after v{last}: the version went back")
            last = max(last, w.version)
            row, before = w.row, w.before
            if w.fence != row["fence"] or row["state"] != "held":
                out.append(
                    f"checkpoint: {what} stored in a {row['state']} row of fence {row['fence']}: "
                    "not the current fence's live lease"
                )
            elif (
                before is None
                or before["fence"] != w.fence
                or before["owner_id"] != row["owner_id"]
                or before["state"] != "held"
                or before["expire_us"] is None
                or before["expire_us"] <= w.write_us
            ):
                was = (
                    "a task never claimed"
                    if before is None
                    else f"fence {before['fence']} {before['state']} until {before['expire_us']}"
                )
                out.append(f"checkpoint: {what} but the lease was not live then ({was})")
            written_by = _data_fence(w.data)
            if written_by is not None and written_by != (w.fence, w.version):
                out.append(
                    f"checkpoint: {what} carries the data written by fence {written_by[0]} "
                    f"as v{written_by[1]}"
                )


def _data_fence(data: str | None) -> tuple[int, int] | None:
    """``(fence, version)`` named by a worker's checkpoint data, None for other data."""
    if not data:
        return None
    try:
        named = json.loads(data)
        return int(named["fence"]), int(named["v"])
    except (ValueError, KeyError, TypeError):
        return None


def _find_write(
    writes: Mapping[str, list[CheckpointWrite]], task: str, version: int
) -> CheckpointWrite | None:
    return next((w for w in writes.get(task, []) if w.version == version), None)


def _check_handed_out(
    who: str,
    task: str,
    version: int,
    fence: int | None,
    write_us: int | None,
    data: str | None,
    writes: Mapping[str, list[CheckpointWrite]],
    out: list[str],
) -> None:
    """A checkpoint handed out (``version`` >= 1) is a recorded write, unchanged."""
    w = _find_write(writes, task, version)
    if w is None:
        out.append(f"checkpoint: {who} {task} v{version}, which the database never stored")
        return
    told = (fence, write_us, data)
    stored = (w.fence, w.write_us, w.data)
    if any(t is not None and t != s for t, s in zip(told, stored, strict=True)):
        out.append(
            f"checkpoint: {who} {task} v{version} as (fence, instant, data) {told}, "
            f"the database wrote {stored}"
        )


def _check_checkpoints_handed_out(
    events: Sequence[Row],
    versions: Sequence[Row],
    tasks: Sequence[Row],
    writes: Mapping[str, list[CheckpointWrite]],
    out: list[str],
    counts: Counter[str],
) -> None:
    at_grant: dict[tuple[str, int], int] = {}
    for v in versions:
        at_grant.setdefault((v["task_id"], v["fence"]), v.get("checkpoint_version") or 0)
    handed: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        if e["ev"] not in ("grant", "observed") or "cp_version" not in e:
            continue
        task, version = e["task"], e["cp_version"]
        if e["ev"] == "grant":
            who = f"grant {task}/{e['fence']} to {e['w']} handed"
            counts["checkpoints.resumed"] += version > 0
            handed[task].append((e["fence"], version))
            stored = at_grant.get((task, e["fence"]))
            if stored is not None and stored != version:
                out.append(f"checkpoint: {who} v{version}, the database had v{stored} at the grant")
        else:
            who = "GetLease read"
            counts["checkpoints.observed"] += version > 0
        if version > 0:
            data = e.get("cp_data")
            _check_handed_out(
                who, task, version, e.get("cp_fence"), e.get("cp_write_us"), data, writes, out
            )
    for task, grants in handed.items():
        grants.sort()
        for (f0, v0), (f1, v1) in itertools.pairwise(grants):
            if v1 < v0:
                out.append(
                    f"checkpoint: {task}'s grant of fence {f1} handed v{v1} after fence {f0}'s "
                    f"grant handed v{v0}"
                )
    for t in tasks:
        version = t.get("checkpoint_version")
        if version is not None:
            _check_handed_out(
                "the end has",
                t["task_id"],
                version,
                t.get("checkpoint_fence"),
                t.get("checkpoint_us"),
                t.get("checkpoint_data"),
                writes,
                out,
            )


def _check_checkpoints_acknowledged(
    events: Sequence[Row],
    tasks: Sequence[Row],
    writes: Mapping[str, list[CheckpointWrite]],
    out: list[str],
    counts: Counter[str],
) -> None:
    final = {t["task_id"]: t.get("checkpoint_version") or 0 for t in tasks}
    for e in events:
        if e["ev"].startswith("checkpoint_") and e.get("lost"):
            counts["checkpoints.sent_after_loss"] += 1
        if e["ev"] == "checkpoint_lost" and e.get("code") == "ABORTED":
            counts[f"checkpoints.refused.{e['reason']}"] += 1
        if e["ev"] == "checkpoint_not_newer":
            out.append(
                f"checkpoint: {e['w']}'s save of {e['task']} v{e['version']} by fence "
                f"{e['fence']} refused as not newer (stored v{e['current']}), though only that "
                "fence wrote since its grant, in rising versions"
            )
            continue
        if e["ev"] != "checkpoint_saved":
            continue
        counts[f"checkpoints.acknowledged.{e['via']}"] += 1
        task, fence, version = e["task"], e["fence"], e["version"]
        what = f"{e['w']}'s save of {task} v{version} by fence {fence} acknowledged OK"
        w = _find_write(writes, task, version)
        if (e["saved_version"], e["saved_fence"]) != (version, fence):
            out.append(f"checkpoint: {what} as v{e['saved_version']} by {e['saved_fence']}")
        if w is None or w.fence != fence:
            by = "no such write" if w is None else f"the write of fence {w.fence}"
            out.append(f"checkpoint: {what}, but the database has {by}")
        elif e.get("write_us") is not None and e["write_us"] != w.write_us:
            out.append(f"checkpoint: {what} at {e['write_us']}, the database wrote at {w.write_us}")
        if final.get(task, 0) < version:
            out.append(f"checkpoint: {what} is lost: {task} ends at v{final.get(task, 0)}")


def _check_terminal(
    events: Sequence[Row],
    versions: Sequence[Row],
    tasks: Sequence[Row],
    out: list[str],
    counts: Counter[str],
) -> None:
    ended: dict[str, Row] = {}
    for v in versions:
        task = v["task_id"]
        end = ended.get(task)
        if end is None:
            if v["state"] in TASK_ENDED_STATES:
                ended[task] = v
                counts[f"tasks.{v['state']}"] += 1
            continue
        if (v["fence"], v["state"], _checkpoint_of(v)) != (
            end["fence"],
            end["state"],
            _checkpoint_of(end),
        ):
            out.append(
                f"terminal: {task} {end['state']} at fence {end['fence']}, then {v['state']} "
                f"at fence {v['fence']} with checkpoint v{v.get('checkpoint_version')}"
            )
    final = {t["task_id"]: t.get("state") for t in tasks}
    acknowledged = {"cancel": "cancelled", "completed": "completed", "failed": "failed"}
    for e in events:
        state = acknowledged.get(e["ev"])
        if state is None:
            continue
        counts[f"acknowledged.{e['ev']}"] += 1
        if final.get(e["task"]) != state:
            out.append(
                f"terminal: {e['w']}'s {e['ev']} of {e['task']} acknowledged OK "
                f"(answered {e['state']}), but the task ends {final.get(e['task'])}"
            )


def _used_up(row: Row) -> bool:
    """The rule of fragment ``attempt_used_up``: this lease's ending uses up the last attempt."""
    limit = row.get("max_attempts")
    return limit is not None and (row.get("attempts") or 0) + 1 >= limit


def _quarantined_at(row: Row, at_us: int) -> bool:
    """Whether ``row`` is a QUARANTINED task at ``at_us`` (stored, or derived)."""
    if row["state"] == "quarantined":
        return True
    return (
        row["state"] == "held"
        and row["expire_us"] is not None
        and row["expire_us"] <= at_us
        and _used_up(row)
    )


def _check_attempts(
    events: Sequence[Row], versions: Sequence[Row], out: list[str], counts: Counter[str]
) -> None:
    previous: dict[str, Row] = {}
    for v in versions:
        task = v["task_id"]
        before = previous.get(task)
        previous[task] = v
        limit, attempts = v.get("max_attempts"), v.get("attempts") or 0
        granted = before is None or before["fence"] != v["fence"]
        if v["state"] == "quarantined" and (before is None or before["state"] != "quarantined"):
            counts["quarantines"] += 1
        if v["state"] == "retried" and (before is None or before["state"] != "retried"):
            counts["retries"] += 1
            if before is None or not _quarantined_at(before, v["update_us"]):
                was = "never claimed" if before is None else before["state"]
                out.append(f"attempts: {task} retried at fence {v['fence']} while {was}")
            if attempts != 0:
                out.append(f"attempts: {task} retried with attempts {attempts}, not 0")
        if granted and before is not None and _quarantined_at(before, v["claim_us"]):
            out.append(
                f"attempts: {task} fence {v['fence']} granted while QUARANTINED "
                f"(fence {before['fence']} {before['state']}, attempts {before.get('attempts')} "
                f"of {before.get('max_attempts')})"
            )
        if limit is None:
            continue
        if v["state"] == "held" and attempts >= limit:
            out.append(
                f"attempts: {task} fence {v['fence']} held as attempt {attempts + 1} of {limit}"
            )
        if v["state"] == "quarantined" and attempts != limit:
            out.append(f"attempts: {task} stored QUARANTINED after {attempts} attempts of {limit}")
    for e in events:
        if e["ev"] == "claim_quarantined":
            counts["claims.refused_quarantined"] += 1
        if e["ev"] == "observed" and e["state"] == "QUARANTINED":
            counts["observed.quarantined"] += 1
            if e["max_attempts"] and e["attempts"] != e["max_attempts"]:
                out.append(
                    f"attempts: GetLease answered {e['task']} QUARANTINED after "
                    f"{e['attempts']} attempts of {e['max_attempts']}"
                )


def _check_task_history(
    task_history: Sequence[Row],
    versions: Sequence[Row],
    writes: Mapping[str, list[CheckpointWrite]],
    out: list[str],
    counts: Counter[str],
) -> None:
    entries: dict[str, list[Row]] = defaultdict(list)
    for h in task_history:
        entries[h["task_id"]].append(h)
    grants: dict[str, dict[tuple[int, str, int], int]] = defaultdict(dict)
    seen: set[tuple[str, int]] = set()
    for v in versions:  # a grant is the first version of its fence
        if (v["task_id"], v["fence"]) not in seen:
            seen.add((v["task_id"], v["fence"]))
            key = (v["fence"], v["owner_id"], (v.get("attempts") or 0) + 1)
            grants[v["task_id"]][key] = v["claim_us"]
    for task in set(grants) | set(entries):
        kept = entries.get(task, [])
        if len(kept) >= HISTORY_KEPT_PER_TASK:
            counts["task_history.pruned_tasks"] += 1
            continue
        counts["task_history.entries"] += len(kept)
        granted = {
            (h["fence"], h["owner_id"], h["attempt"]): h["event_us"]
            for h in kept
            if h["kind"] == "granted"
        }
        _compare(f"{task} grant (fence, owner, attempt)", grants.get(task, {}), granted, out)
        saved = {
            (h["checkpoint_version"], h["fence"]): h["event_us"]
            for h in kept
            if h["kind"] == "checkpoint_saved"
        }
        written = {(w.version, w.fence): w.write_us for w in writes.get(task, [])}
        _compare(f"{task} checkpoint (version, fence)", written, saved, out)


def _compare(
    what: str, database: Mapping[Any, int], history: Mapping[Any, int], out: list[str]
) -> None:
    """The database's record against the task history's entries: each in both, at one instant."""
    for key in sorted(set(database) | set(history)):
        if key not in history:
            out.append(f"task-history: {what} {key} is not in the task's history")
        elif key not in database:
            out.append(f"task-history: the task's history has {what} {key}, the database not")
        elif database[key] != history[key]:
            out.append(
                f"task-history: {what} {key} at {database[key]}, its history entry at "
                f"{history[key]}"
            )

"""What was acknowledged and what the database kept: the HA tier's loss and reuse counts.

A pure function of plain data, like :mod:`tests.fault.history.checker` (the
same inputs: the history's JSON events, the database's row versions, final
task rows, effect ledger records and outside-system applies, instants as
microseconds), so ``test_accounting.py`` feeds it hand-made histories.

An answer OK is an acknowledgement; after a failover the new primary must
still have what was acknowledged:

* **grants**: every ``grant`` event (task, fence, owner) is a version of that
  task with that fence and owner;
* **releases**: every acknowledged end of a lease, ``released_ok`` (the HA
  probe's Release), ``completed`` and ``failed`` (a worker's complete or fail)
  and ``cancel`` (the operator's Cancel), is a version of that task with that
  fence in the matching row state;
* **checkpoints**: every ``checkpoint_saved`` (task, fence, saved version) is
  a version carrying that checkpoint version written by that fence;
* **effects**: every ``effect`` (the ledger's answer to a worker: task, key,
  fence) is a ledger record of that task and key: a ONCE one that succeeded
  with the same result (whichever fence did it); a LATEST one that succeeded
  under that fence, or that a later fence has begun since; every ``applied``
  (the outside system's commit) is an apply row.

A **reused** fence is one (task, fence) acknowledged to two owners, or
acknowledged to one owner while the database gives that fence to another:
the one thing a failover must never do, whatever it loses.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]
FENCES_PER_TIMELINE = 2**40
# The row state an acknowledged end of a lease leaves (the event's name -> states).
RELEASE_STATES: dict[str, frozenset[str]] = {
    "released_ok": frozenset({"released"}),
    "completed": frozenset({"completed"}),
    "failed": frozenset({"failed"}),
    "cancel": frozenset({"cancelled"}),
}


def timeline_of(fence: int) -> int:
    """The PostgreSQL timeline a fence was granted on (migration 0003: fences start at
    ``(timeline - 1) * 2**40 + 1``)."""
    return (fence - 1) // FENCES_PER_TIMELINE + 1


@dataclasses.dataclass
class Accounting:
    """Counts of acknowledged writes and of those the database no longer has."""

    grants: int = 0
    grants_lost: int = 0
    releases: int = 0
    releases_lost: int = 0
    checkpoints: int = 0
    checkpoints_lost: int = 0
    effects: int = 0
    effects_lost: int = 0
    applies: int = 0
    applies_lost: int = 0
    fences_reused: int = 0
    lost_grants: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    findings: list[str] = dataclasses.field(default_factory=list)

    @property
    def lost(self) -> int:
        """Every acknowledged write the database no longer has."""
        return (
            self.grants_lost
            + self.releases_lost
            + self.checkpoints_lost
            + self.effects_lost
            + self.applies_lost
        )

    def __add__(self, other: Accounting) -> Accounting:
        summed: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            summed[field.name] = getattr(self, field.name) + getattr(other, field.name)
        return Accounting(**summed)

    def counts(self) -> dict[str, int]:
        """The counts alone (for results.json)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), int)
        }


def account(
    events: Sequence[Row],
    versions: Sequence[Row],
    effects: Sequence[Row] = (),
    applies: Sequence[Row] = (),
) -> Accounting:
    """Counts acknowledged writes and the ones lost, and reused fences, for one namespace.

    Args:
        events: History events (``ev`` and its fields, as the workers, the
            operator and the HA probe write them).
        versions: Every version of the namespace's task rows
            (``history_task_versions``: ``task_id``, ``fence``, ``owner_id``,
            ``state``, ``checkpoint_version``, ``checkpoint_fence``).
        effects: The namespace's ledger records (``task_id``, ``effect_key``,
            ``policy`` ONCE/LATEST, ``state``, ``complete_fence``, ``result`` text).
        applies: The outside system's apply rows (``apply_id``).

    Returns:
        The counts; ``findings`` names each loss or reuse, one line each.
    """
    out = Accounting()
    owners: dict[tuple[str, int], set[str]] = defaultdict(set)
    states: dict[tuple[str, int], set[str]] = defaultdict(set)
    checkpoints: set[tuple[str, int, int]] = set()
    for v in versions:
        key = (v["task_id"], v["fence"])
        owners[key].add(v["owner_id"])
        states[key].add(v["state"])
        if v.get("checkpoint_version") is not None:
            checkpoints.add((v["task_id"], v["checkpoint_fence"], v["checkpoint_version"]))
    for key, found in owners.items():
        if len(found) > 1:
            out.fences_reused += 1
            out.findings.append(f"reused: {key[0]}/{key[1]} is {sorted(found)}'s in the database")
    ledger = {(r["task_id"], r["effect_key"]): r for r in effects}
    apply_ids = {a["apply_id"] for a in applies}

    granted: dict[tuple[str, int], set[str]] = defaultdict(set)
    for e in events:
        ev = e["ev"]
        if ev == "grant":
            task, fence, owner = e["task"], e["fence"], e["owner"]
            if owner in granted[(task, fence)]:
                continue
            granted[(task, fence)].add(owner)
            out.grants += 1
            recorded = owners.get((task, fence), set())
            if owner not in recorded:
                if recorded:
                    out.fences_reused += 1
                    out.findings.append(
                        f"reused: {task}/{fence} acknowledged to {owner}, the database gives it "
                        f"to {sorted(recorded)}"
                    )
                else:
                    out.grants_lost += 1
                    out.lost_grants.append((task, fence, owner))
                    out.findings.append(f"lost grant: {task}/{fence} to {owner}")
        elif ev in RELEASE_STATES:
            out.releases += 1
            if not states.get((e["task"], e["fence"]), set()) & RELEASE_STATES[ev]:
                out.releases_lost += 1
                out.findings.append(f"lost {ev}: {e['task']}/{e['fence']}")
        elif ev == "checkpoint_saved":
            out.checkpoints += 1
            if (e["task"], e["fence"], e["saved_version"]) not in checkpoints:
                out.checkpoints_lost += 1
                out.findings.append(
                    f"lost checkpoint: {e['task']} v{e['saved_version']} by fence {e['fence']}"
                )
        elif ev == "effect":
            out.effects += 1
            record = ledger.get((e["task"], e["key"]))
            kept = record is not None and (
                record["state"] == "succeeded" and record["result"] == e["result"]
                if e["policy"] == "ONCE"
                # A later fence may have begun the effect since (then in doubt).
                else record["fence"] >= e["fence"]
                and (record["state"] == "succeeded" or record["fence"] > e["fence"])
            )
            if not kept:
                out.effects_lost += 1
                out.findings.append(
                    f"lost effect: {e['task']}/{e['key']} ({e['policy']}) by fence {e['fence']}"
                )
        elif ev == "applied":
            out.applies += 1
            if e["apply_id"] not in apply_ids:
                out.applies_lost += 1
                out.findings.append(f"lost apply: {e['task']} apply {e['apply_id']}")
    for (task, fence), found in granted.items():
        if len(found) > 1:
            out.fences_reused += 1
            out.findings.append(f"reused: {task}/{fence} acknowledged to {sorted(found)}")
    return out

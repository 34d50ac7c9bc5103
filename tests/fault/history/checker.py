"""Checks a recorded history of the workload against what leasekeeper promises.

Inputs are plain data, so the checker is a pure function that unit tests can
feed with hand-made histories (``tests/unit/test_history_checker.py``):

* ``events``: what every worker and the operator were told, one dict per
  JSON line written by :mod:`tests.fault.history.worker` and
  :mod:`tests.fault.history.operator` (``ev`` names the event);
* ``faults``: what the workload did to the workers, servers and networks,
  with monotonic times (``t``, ``until``);
* ``versions``: every version of every task row, in the order the database
  wrote them (``history_task_versions``, written by a trigger in the same
  transaction as the change, instants as microseconds on the database clock).
  Each version carries the task's ``attempts`` and ``max_attempts`` and its
  checkpoint (``checkpoint_version``, ``checkpoint_fence``, ``checkpoint_us``,
  ``checkpoint_data``); versions without these keys (an older record) have no
  checkpoint and no attempt limit;
* ``tasks``: the task rows at the end; ``applies``: the outside system's record
  of every effect applied (``history_applies``, in commit order per task);
  ``effects``: the effect ledger's records at the end;
* ``task_history`` (optional): the service's own task history
  (``leasekeeper_task_history``, by sequence, ``event_us``).

The properties (each violation is one line naming the evidence):

1. ``fence-order``: per task, fences in the database never decrease, a fence
   belongs to one owner only, and every fence a worker was granted is that
   owner's in the database, no higher than the task's final fence (an
   acknowledged grant is never lost).
2. ``one-holder``: per task, the lease of each fence ends (its last expire_time,
   or the instant it was released) no later than the next fence's claim_time,
   unless both fences are the same owner's (a new incarnation of an owner
   supersedes its own lease): no two owners hold a task at one database instant.
3. ``validate``: ValidateFence answered valid only at an instant inside its
   fence's lease (between its claim_time and its end or the next fence's
   claim_time, whichever is sooner), except after a Cancel's instant when it
   was sent before the Cancel was acknowledged: the Cancel cuts the lease at
   its clock reading, before it commits, and a read that began before the
   commit answers from the row it read (the instant it reports is read later).
   ``no-revival``: a renewal never extends a lease after its expire_time.
   ``remaining-ttl``: every grant's ``remaining_ttl`` is consistent with its
   ``expire_time`` and ``claim_time`` (the instant the answer describes,
   ``expire_time - remaining_ttl``, is not before the grant), so a worker's
   trust deadline is never planned on an overstated ttl.
4. ``effect-once``: no ONCE effect was applied twice; per task, applies were
   accepted in non-decreasing fence order (a stale fence never acted after a
   newer one); the ledger's ONCE records agree with the applies (a SUCCEEDED
   record names an existing apply; no FAILED record for an applied effect)
   and every worker that got a ONCE effect's result got the same one.
5. ``trust``: a worker learnt of every loss by its local trust deadline
   (within ``tolerance_s``, 0.5 s by default: the scheduling delay a timer may
   suffer on a loaded 2-core machine, where 0.28 s has been seen; judged on
   ``cancelled`` events: the moment ``hold()`` cancelled its work), and never
   started an apply after its deadline,
   unless it was paused (SIGSTOP) or starved of the CPU (a ``stall`` event:
   its event loop woke 0.1 s or more late) around that moment: such a process
   cannot run its timers, which is what fencing is for.
6. ``checkpoint``: a write is a version whose checkpoint differs from the
   task's previous version. Every write moves the version forward (nothing
   clears a checkpoint) and was made by the task's current fence, its owner,
   while that lease was live: the version before it is the same fence's
   ``held`` row with an expire_time after the write's instant. The data names
   the fence that wrote it. Every checkpoint handed out (with a grant, by
   GetLease, the task's row at the end) is one of these writes, unchanged; a
   grant hands out exactly the checkpoint stored when it was granted, so per
   task the versions grants hand out never go back in fence order. A save
   acknowledged OK is a write of that fence and version (a stale fence's save
   is never acknowledged) and is not lost: the task's final version is at
   least its version. A save refused as not newer is a violation too: only
   the saving fence wrote since its grant, in rising versions.
7. ``terminal``: after a version COMPLETED, FAILED or CANCELLED the task never
   changes again (no grant, no checkpoint); a Cancel, complete or fail
   acknowledged OK is the task's final state.
8. ``attempts``: no grant takes a QUARANTINED task (a stored ``quarantined``
   row, or an expired lease whose ending used up the last attempt) and a
   Retry puts back only a QUARANTINED task. Assuming every claim of a task
   carries the same limit (the workload's do): no grant is an attempt beyond
   ``max_attempts``, and a QUARANTINED task (stored, or answered by GetLease)
   has used exactly ``max_attempts``.
9. ``task-history``: the service's task history has a GRANTED entry for every
   grant (fence, owner, attempt) and a CHECKPOINT_SAVED entry for every
   checkpoint write (version, fence, instant), and none for a grant or a
   write the database does not have. Tasks with ``HISTORY_KEPT_PER_TASK``
   entries or more may have been pruned and are left out.

Properties 6 to 9 (runs) are checked in :mod:`tests.fault.history.runs`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from .runs import Row, check_runs

# Row states that end the current fence's lease (its expire_time is cut to then, or passed).
LEASE_ENDED_STATES = frozenset(
    {"released", "completed", "revoked", "cancelled", "failed", "quarantined", "retried"}
)


@dataclasses.dataclass
class LeaseSpan:
    """One fence's lease on one task as the database recorded it (microseconds)."""

    fence: int
    owner_id: str
    claim_us: int
    end_us: int
    reign_end_us: int = 0  # end_us, or the next fence's claim_us if sooner


@dataclasses.dataclass
class Verdict:
    """What the checker found: violations (must be empty) and counts."""

    violations: list[str]
    counts: Counter[str]

    @property
    def ok(self) -> bool:
        return not self.violations


def lease_spans(versions: Iterable[Row]) -> dict[str, list[LeaseSpan]]:
    """Per task, each fence's lease span, in fence order, from the row versions."""
    spans: dict[str, dict[int, LeaseSpan]] = defaultdict(dict)
    for v in versions:
        task, fence = v["task_id"], v["fence"]
        span = spans[task].get(fence)
        if span is None:
            span = spans[task][fence] = LeaseSpan(fence, v["owner_id"], v["claim_us"], 0)
        if v["state"] == "held":
            span.end_us = max(span.end_us, v["expire_us"])
        elif v["state"] in LEASE_ENDED_STATES and v["expire_us"] is not None:
            # A release ends the lease at once (the row's expire_time is cut to then).
            span.end_us = min(span.end_us, v["expire_us"]) if span.end_us else v["expire_us"]
    ordered = {task: [by_fence[f] for f in sorted(by_fence)] for task, by_fence in spans.items()}
    for leases in ordered.values():
        for span, after in itertools.zip_longest(leases, leases[1:]):
            span.reign_end_us = span.end_us if after is None else min(span.end_us, after.claim_us)
    return ordered


def check(
    events: Sequence[Row],
    faults: Sequence[Row],
    versions: Sequence[Row],
    tasks: Sequence[Row],
    applies: Sequence[Row],
    effects: Sequence[Row],
    *,
    task_history: Sequence[Row] | None = None,
    tolerance_s: float = 0.5,
) -> Verdict:
    """Checks one history; see the module docstring for the properties."""
    out: list[str] = []
    counts: Counter[str] = Counter()
    for e in events:
        counts[f"event.{e['ev']}"] += 1
    for f in faults:
        counts[f"fault.{f['kind']}"] += 1
    spans = lease_spans(versions)
    _check_fence_order(events, versions, tasks, out)
    _check_one_holder(spans, out)
    _check_no_revival(versions, out)
    _check_answer_instants(events, out)
    _check_validate(events, versions, spans, out, counts)
    _check_effects(events, applies, effects, out, counts)
    _check_trust(events, faults, tolerance_s, out, counts)
    check_runs(events, versions, tasks, task_history, out, counts)
    counts["grants.database"] = sum(len(s) for s in spans.values())
    refused_by_service = sum(1 for e in events if e["ev"] == "lost" and e.get("code") == "ABORTED")
    counts["lost.refused_by_service"] = refused_by_service
    counts["stale_fences_refused"] = (
        counts["event.apply_refused"] + counts["validate.refused_own_fence"] + refused_by_service
    )
    counts["violations"] = len(out)
    return Verdict(out, counts)


def _check_fence_order(
    events: Sequence[Row], versions: Sequence[Row], tasks: Sequence[Row], out: list[str]
) -> None:
    owner_of: dict[tuple[str, int], str] = {}
    last_fence: dict[str, int] = {}
    for v in versions:
        task, fence = v["task_id"], v["fence"]
        if fence < last_fence.get(task, 0):
            out.append(f"fence-order: {task} went from fence {last_fence[task]} back to {fence}")
        last_fence[task] = max(fence, last_fence.get(task, 0))
        known = owner_of.setdefault((task, fence), v["owner_id"])
        if known != v["owner_id"]:
            out.append(f"fence-order: {task} fence {fence} given to {known} and {v['owner_id']}")
    final = {t["task_id"]: t["fence"] for t in tasks}
    granted: dict[tuple[str, int], str] = {}
    for e in events:
        if e["ev"] != "grant":
            continue
        task, fence, owner = e["task"], e["fence"], e["owner"]
        first = granted.setdefault((task, fence), owner)
        if first != owner:
            out.append(f"fence-order: workers {first} and {owner} were both granted {task}/{fence}")
        recorded = owner_of.get((task, fence))
        if recorded != owner:
            out.append(
                f"fence-order: grant {task}/{fence} to {owner} acknowledged but the database "
                f"has {recorded or 'no such grant'}"
            )
        if final.get(task, 0) < fence:
            out.append(f"fence-order: {task} ends at fence {final.get(task)} below granted {fence}")


def _check_no_revival(versions: Sequence[Row], out: list[str]) -> None:
    previous: dict[str, Row] = {}
    for v in versions:
        before = previous.get(v["task_id"])
        previous[v["task_id"]] = v
        if before is None or (before["fence"], before["state"]) != (v["fence"], "held"):
            continue
        if v["state"] == "held" and v["update_us"] >= before["expire_us"]:
            out.append(
                f"no-revival: {v['task_id']} fence {v['fence']} renewed "
                f"{(v['update_us'] - before['expire_us']) / 1e6:.6f} s after it expired"
            )


def _check_answer_instants(events: Sequence[Row], out: list[str]) -> None:
    for e in events:
        if e["ev"] == "grant" and e["db_now_us"] < e["claim_us"]:
            out.append(
                f"remaining-ttl: grant {e['task']}/{e['fence']} to {e['w']} describes an instant "
                f"{(e['claim_us'] - e['db_now_us']) / 1e6:.6f} s before the grant "
                "(expire_time - remaining_ttl < claim_time: the ttl was overstated)"
            )


def _check_one_holder(spans: Mapping[str, list[LeaseSpan]], out: list[str]) -> None:
    for task, leases in spans.items():
        for older, newer in itertools.pairwise(leases):
            # An owner may supersede its own lease (a new incarnation's claim);
            # only two different owners at one instant break the promise.
            if newer.claim_us < older.end_us and newer.owner_id != older.owner_id:
                out.append(
                    f"one-holder: {task} fence {newer.fence} ({newer.owner_id}) claimed "
                    f"{(older.end_us - newer.claim_us) / 1e6:.6f} s before fence {older.fence} "
                    f"({older.owner_id}) ended"
                )


def _check_validate(
    events: Sequence[Row],
    versions: Sequence[Row],
    spans: Mapping[str, list[LeaseSpan]],
    out: list[str],
    counts: Counter[str],
) -> None:
    # A Cancel cuts the lease at its clock reading, before it commits; a ValidateFence
    # that read the row before that commit answers from the row it read. Only one
    # sent after the Cancel was acknowledged must see it.
    cancelled = {(v["task_id"], v["fence"]): v for v in versions if v["state"] == "cancelled"}
    held_until: dict[tuple[str, int], int] = {}
    for v in versions:
        if v["state"] == "held":
            key = (v["task_id"], v["fence"])
            held_until[key] = max(held_until.get(key, 0), v["expire_us"])
    cancels_acknowledged: dict[str, float] = {}
    for e in events:
        if e["ev"] == "cancel":
            first = cancels_acknowledged.get(e["task"], e["t"])
            cancels_acknowledged[e["task"]] = min(first, e["t"])
    for e in events:
        if e["ev"] != "validate":
            continue
        if not e["valid"]:
            counts["validate.refused_own_fence"] += 1
            continue
        counts["validate.valid"] += 1
        task, fence = e["task"], e["fence"]
        span = next((s for s in spans.get(task, []) if s.fence == fence), None)
        t = e["db_now_us"]
        if span is not None and span.claim_us <= t < span.reign_end_us:
            continue
        cut = cancelled.get((task, fence))
        if (
            span is not None
            and cut is not None
            and span.claim_us <= t < held_until.get((task, fence), 0)
            and e.get("sent_t", e["t"]) < cancels_acknowledged.get(task, float("inf"))
        ):
            counts["validate.concurrent_with_cancel"] += 1
            continue
        where = "no such lease" if span is None else f"lease [{span.claim_us}, {span.reign_end_us})"
        out.append(f"validate: {task}/{fence} valid at {t}, outside its {where}")


def _check_effects(
    events: Sequence[Row],
    applies: Sequence[Row],
    effects: Sequence[Row],
    out: list[str],
    counts: Counter[str],
) -> None:
    applied: dict[tuple[str, str], list[Row]] = defaultdict(list)
    highest: dict[str, int] = {}
    for a in applies:
        task = a["task_id"]
        applied[(task, a["effect_key"])].append(a)
        if a["fence"] < highest.get(task, 0):
            out.append(
                f"effect-once: {task} apply {a['apply_id']} with fence {a['fence']} accepted "
                f"after fence {highest[task]}"
            )
        highest[task] = max(highest.get(task, 0), a["fence"])
        counts[f"applies.{a['policy']}"] += 1
    for (task, key), rows in applied.items():
        if rows[0]["policy"] == "ONCE" and len(rows) > 1:
            ids = [r["apply_id"] for r in rows]
            out.append(f"effect-once: ONCE effect {task}/{key} applied {len(rows)} times: {ids}")
    apply_ids = {f"apply-{a['apply_id']}": a for a in applies}
    ledger: dict[tuple[str, str], Row] = {}
    for r in effects:
        ledger[(r["task_id"], r["effect_key"])] = r
        counts[f"ledger.{r['policy']}.{r['state']}"] += 1
        if r["policy"] != "ONCE":
            continue
        done = applied.get((r["task_id"], r["effect_key"]), [])
        if r["state"] == "succeeded":
            a = apply_ids.get(r["result"])
            if a is None or (a["task_id"], a["effect_key"]) != (r["task_id"], r["effect_key"]):
                out.append(
                    f"effect-once: ledger says {r['task_id']}/{r['effect_key']} succeeded as "
                    f"{r['result']!r}, which the outside system does not have"
                )
        elif r["state"] == "failed" and done:
            out.append(
                f"effect-once: ledger says {r['task_id']}/{r['effect_key']} failed, but it was "
                f"applied as {[a['apply_id'] for a in done]}"
            )
    for e in events:
        if e["ev"] != "effect" or e["policy"] != "ONCE":
            continue
        r = ledger.get((e["task"], e["key"]))
        if r is None or r["state"] != "succeeded" or r["result"] != e["result"]:
            out.append(
                f"effect-once: worker {e['w']} got {e['result']!r} for {e['task']}/{e['key']}, "
                f"the ledger has {None if r is None else (r['state'], r['result'])}"
            )


def _paused_near(
    pauses: Mapping[str, list[tuple[float, float]]], worker: str, start: float, end: float
) -> bool:
    return any(p0 <= end and p1 >= start for p0, p1 in pauses.get(worker, []))


def _check_trust(
    events: Sequence[Row],
    faults: Sequence[Row],
    tolerance_s: float,
    out: list[str],
    counts: Counter[str],
) -> None:
    pauses: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for f in faults:
        if f["kind"] == "pause_worker":
            pauses[f["target"]].append((f["t"], f["until"]))
    stalls: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ev"] == "stall":
            stalls[e["w"]].append((e["since"], e["since"] + e["stall_s"]))
            counts["stalls.max_ms"] = max(counts["stalls.max_ms"], round(e["stall_s"] * 1000))
    late_max_s = 0.0
    for e in events:
        deadline = e.get("deadline")
        if deadline is None:
            continue
        if e["ev"] == "cancelled":
            counts[f"lost.{e['reason']}"] += 1
            late_s = e["lost_t"] - deadline
            if late_s <= tolerance_s:
                late_max_s = max(late_max_s, late_s)
            elif _paused_near(pauses, e["w"], deadline - tolerance_s, e["lost_t"]):
                counts["lost.late_after_pause"] += 1
            elif _paused_near(stalls, e["w"], deadline - tolerance_s, e["lost_t"]):
                counts["lost.late_after_stall"] += 1
            else:
                out.append(
                    f"trust: worker {e['w']} learnt of losing {e['task']}/{e['fence']} "
                    f"({e['reason']}) {late_s:.3f} s after its trust deadline"
                )
        elif e["ev"] == "apply" and (e["lost"] or e["t"] > deadline + tolerance_s):
            if _paused_near(pauses, e["w"], deadline - tolerance_s, e["t"]):
                counts["apply.after_pause"] += 1
            elif _paused_near(stalls, e["w"], deadline - tolerance_s, e["t"]):
                counts["apply.after_stall"] += 1
            else:
                out.append(
                    f"trust: worker {e['w']} started an apply of {e['task']}/{e['fence']} "
                    f"{e['t'] - deadline:.3f} s after its trust deadline (lost={e['lost']})"
                )
    counts["lost.max_late_ms"] = round(late_max_s * 1000)

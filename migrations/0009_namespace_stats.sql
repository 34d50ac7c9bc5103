-- The indexes GetNamespaceStats counts from (statement namespace_stats in
-- server/leasekeeper_server/storage/sql/queries.sql), so that each of its
-- figures reads only the rows it counts, at most its count limit of them: a
-- call's cost never follows a namespace's size or the tables'. Without them,
-- a namespace's expired and quarantined tasks, its last minute of history
-- and its reserved effects could be found only by reading all of its tasks,
-- the last minute of every namespace's history, or all of its effects.
--
-- Each is partial: it holds only the rows counted. Renewals stay HOT
-- updates: no column they change is named here (predicates included). What
-- each costs the writes is said with it. Each is built when this migration
-- runs, in its transaction (where CREATE INDEX CONCURRENTLY cannot run):
-- writes to its table wait until it is built, longer the larger the table.

-- Leases whose expiry the sweeper announced and that nobody claimed since
-- (EXPIRED; an announced expiry that used up the task's last attempt is
-- stored 'quarantined' instead). A row enters at its announcement and leaves
-- at its next claim, release or revoke: updates that change an indexed column
-- already (fence or state, named by leasekeeper_tasks_unswept), never HOT.
CREATE INDEX leasekeeper_tasks_expired
    ON leasekeeper_tasks (namespace, task_id)
    WHERE state = 'held' AND expiry_announced_fence = fence;

-- Quarantined tasks: a row enters at its quarantine and leaves at its retry
-- or cancel, updates of the state (never HOT).
CREATE INDEX leasekeeper_tasks_quarantined
    ON leasekeeper_tasks (namespace, task_id)
    WHERE state = 'quarantined';

-- The history entries of grants, expiries, revokes and refused fences, by
-- namespace, kind and time: a count of one kind over the last minute is one
-- range of it. One more index entry for each such entry (a grant writes one,
-- and so does each lease's expiry or revoke); checkpoint and effect entries,
-- the most numerous, are not in it. The history pruner's deletes clear it as
-- they clear the other indexes.
CREATE INDEX leasekeeper_task_history_recent
    ON leasekeeper_task_history (namespace, kind, event_time)
    WHERE kind IN ('granted', 'expired', 'revoked', 'fence_refused');

-- Effects still RESERVED (an attempt whose outcome nobody has recorded), with
-- the reserving fence, so that a count reads the index alone. A reservation
-- adds an entry. Recording an outcome (CompleteEffect), and reserving a new
-- attempt over a recorded one, change the state or the fence this index
-- names, so those updates are no longer HOT: each adds an entry to the
-- primary key too (vacuum removes the old ones).
CREATE INDEX leasekeeper_effects_reserved
    ON leasekeeper_effects (namespace, task_id, effect_key) INCLUDE (fence)
    WHERE state = 'reserved';

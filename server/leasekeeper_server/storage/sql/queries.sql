-- Every statement the service runs at request time, as named blocks
-- ("-- name: NAME" starts one). storage/queries.py loads this file once, and
-- puts each "-- fragment: NAME" block where a statement says {{NAME}}
-- ({{NAME:EXPR}} also puts EXPR where the fragment says @now).
--
-- Each decision is one statement that reads the database clock itself with
-- clock_timestamp(), never now(): now() is frozen at the start of the
-- transaction, so a statement that waited on a row lock would judge with a
-- stale instant. Reading clock_timestamp() is not enough on its own: a plain
-- UPDATE evaluates its WHERE and SET when it scans the row, before it waits
-- for the row lock, and re-evaluates them only if the locker changed the row
-- (not if it merely locked it: SELECT ... FOR UPDATE, or a claim whose
-- ON CONFLICT WHERE refused). INSERT ... ON CONFLICT DO UPDATE locks the row
-- first and then evaluates its WHERE and SET, so a statement whose decision
-- reads the clock uses that form: the clock it reads is the clock at the
-- moment the row is decided.
-- Every statement returns clock_timestamp() AS db_now, the instant the answer
-- describes; remaining ttls are expire_time - db_now.

-- fragment: attempt_used_up
-- Whether the ending of the row aliased t's lease uses up its task's last
-- attempt (migrations/0008_runs.sql): the task is then QUARANTINED. The one
-- rule; core/model.py applies the same to a row.
(t.max_attempts IS NOT NULL AND t.attempts + 1 >= t.max_attempts)

-- fragment: lease_is_live
-- Whether the row aliased t holds a live lease at instant @now (by default
-- clock_timestamp(); a statement that read the clock once passes its reading):
-- the one rule, written once, that every statement here judges liveness by.
-- core/model.py applies the same rule to a row and its db_now.
(t.state = 'held' AND t.expire_time > @now)

-- fragment: lease_columns
-- A lease as every statement returns it (storage/store.py lease_from_row), from
-- the row aliased t; statements add clock_timestamp() AS db_now after it.
t.namespace, t.task_id, t.owner_id, t.fence, t.state, t.expire_time, t.runtime_deadline,
t.claim_time, t.end_reason, t.claim_request_id, t.revoke_reason, t.attempts, t.max_attempts,
t.state_reason, t.checkpoint_version, octet_length(t.checkpoint_data) AS checkpoint_size

-- fragment: checkpoint_columns
-- The task's checkpoint with its data (storage/store.py checkpoint_from_row),
-- from the row aliased t; only where a checkpoint is handed out.
t.checkpoint_version, t.checkpoint_data, t.checkpoint_content_type, t.checkpoint_fence,
t.checkpoint_time

-- name: claim
-- Grants the lease of each claim of a batch (storage/statements.py ClaimParams;
-- a single claim is a batch of one). Parameters are arrays, one element per
-- claim of a distinct task, named by the unnest below. A claim is granted when
-- its task is new, FREE or EXPIRED past its namespace's lock delay (an expired
-- lease, never released, keeps its task unclaimable until expire_time + lock
-- delay; zero for none), or HELD by the claiming owner under another request
-- id (not NULL: a new incarnation of the owner, which supersedes the earlier
-- one). No row for a claim refused: HELD by another owner, HELD by this owner
-- under the same request id or with none (a retry: store.py hands the same
-- lease back), or COMPLETED (store.py reads the task to say which).
-- Each claim is decided as if alone: the new row's instants come from one
-- reading of the clock per row (c.now), so a ttl clamped to the runtime budget
-- gives expire_time = runtime_deadline exactly, and an expiry at that instant
-- is recognised as RUNTIME_EXCEEDED; ON CONFLICT locks each existing row before
-- its WHERE and SET read the clock. Rows are taken in (namespace, task_id)
-- order, so two batches (of two servers) lock rows in one order and never
-- deadlock.
-- The new fence is at least leasekeeper_fence_floor(), the floor of the
-- database's timeline (migrations/0003_fence_timeline.sql): 1, 2, 3, ... on
-- timeline 1, and above every fence of earlier timelines after a promotion,
-- so grants lost in a failover to an asynchronous standby are never reissued.
-- request_id: see migrations/0004_claim_request_id.sql.
-- Attempts (migrations/0008_runs.sql): taking over an expired lease counts it
-- (attempts + 1); an expired lease whose ending uses up the last attempt is
-- not taken over (the task is QUARANTINED; nor are 'quarantined', 'cancelled',
-- 'failed' and 'completed' rows claimable). The grant stores its claim's
-- max_attempts (NULL: none). The checkpoint comes back with the grant.
WITH p AS MATERIALIZED (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::interval[], $5::interval[],
                         $6::text[], $7::interval[], $8::integer[])
        AS p(namespace, task_id, owner_id, ttl, max_runtime, request_id, lock_delay,
             max_attempts)
)
INSERT INTO leasekeeper_tasks AS t
    (namespace, task_id, owner_id, fence, state,
     expire_time, runtime_deadline, claim_time, update_time, end_reason, claim_request_id,
     max_attempts)
SELECT p.namespace, p.task_id, p.owner_id, leasekeeper_fence_floor(), 'held',
       c.now + least(p.ttl, p.max_runtime), c.now + p.max_runtime,
       c.now, c.now, NULL, p.request_id, p.max_attempts
FROM p, (SELECT clock_timestamp() AS now) c
ORDER BY p.namespace, p.task_id
ON CONFLICT (namespace, task_id) DO UPDATE
SET (owner_id, fence, state, expire_time, runtime_deadline, claim_time, update_time,
     end_reason, claim_request_id, revoke_reason, state_reason, attempts, max_attempts) =
    (SELECT EXCLUDED.owner_id, greatest(t.fence + 1, leasekeeper_fence_floor()), 'held',
            c.now + least(p.ttl, p.max_runtime), c.now + p.max_runtime,
            c.now, c.now, NULL, EXCLUDED.claim_request_id, NULL, NULL,
            t.attempts + CASE WHEN t.state = 'held' AND NOT {{lease_is_live:c.now}}
                              THEN 1 ELSE 0 END,
            p.max_attempts
     FROM p, (SELECT clock_timestamp() AS now) c
     WHERE p.namespace = EXCLUDED.namespace AND p.task_id = EXCLUDED.task_id)
WHERE t.state IN ('released', 'revoked', 'retried')
   OR (t.state = 'held'
       AND NOT {{lease_is_live:clock_timestamp() - (SELECT p.lock_delay FROM p
                                                    WHERE p.namespace = EXCLUDED.namespace
                                                      AND p.task_id = EXCLUDED.task_id)}}
       AND NOT {{attempt_used_up}})
   OR (t.state = 'held' AND t.owner_id = EXCLUDED.owner_id
       AND EXCLUDED.claim_request_id IS NOT NULL
       AND t.claim_request_id IS DISTINCT FROM EXCLUDED.claim_request_id
       AND ({{lease_is_live}} OR NOT {{attempt_used_up}}))
RETURNING {{lease_columns}}, {{checkpoint_columns}}, clock_timestamp() AS db_now;

-- name: renew
-- The renewal of a batch of leases (storage/statements.py RenewParams; a
-- single renewal is a batch of one): arrays, one element per renewal of a
-- distinct task. Heartbeat beats and Renew calls arriving together become this
-- one statement. Extends only a live lease of this owner and fence, to
-- least(clock + ttl, runtime deadline); never revives an expired one.
-- Written as an upsert that never inserts (see the top of this file): a row
-- exists whenever the SELECT yields one (rows are never deleted), so the
-- insert always conflicts, and ON CONFLICT locks each row before its WHERE and
-- SET read the clock, so no renewal revives a lease that expired while the
-- statement waited for the row (a plain UPDATE ... FROM unnest would judge a
-- row it had to wait for with the clock read before the wait). The inserted
-- values only have to satisfy the table's checks. Rows are taken in
-- (namespace, task_id) order (no deadlock between batches). Returns one row
-- per renewed lease; a renewal without a row found no live lease of its owner
-- and fence.
-- Checkpoints (migrations/0008_runs.sql) are written by this statement too,
-- so a beat can carry one and a checkpoint obeys the renewal's rule of
-- ownership: an element with a checkpoint_version stores its checkpoint when
-- the version is higher than the stored one (otherwise the stored one stays,
-- and the returned checkpoint_version says so); an element with a NULL ttl
-- writes its checkpoint without renewing (SaveCheckpoint).
-- Each element's values reach its row's update through EXCLUDED (the proposed
-- row), not by looking the element up in p again: such a lookup scans p for
-- every row, a cost that grew with the square of the batch (1000 renewals:
-- 91-173 ms; through EXCLUDED, 18 ms). The checkpoint columns carry the
-- checkpoint, and checkpoint_time carries the ttl, as 'epoch' + ttl (NULL: no
-- renewal), taken back by subtracting 'epoch'; the proposed row is never
-- stored (its insert always conflicts), so none of it lands in the table.
WITH p AS MATERIALIZED (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::interval[],
                         $6::bigint[], $7::bytea[], $8::text[])
        AS p(namespace, task_id, owner_id, fence, ttl, checkpoint_version, checkpoint_data,
             checkpoint_content_type)
)
INSERT INTO leasekeeper_tasks AS t
    (namespace, task_id, owner_id, fence, state,
     expire_time, runtime_deadline, claim_time, update_time, end_reason,
     checkpoint_version, checkpoint_data, checkpoint_content_type, checkpoint_time)
SELECT p.namespace, p.task_id, p.owner_id, p.fence, 'held',
       clock_timestamp(), clock_timestamp(), clock_timestamp(), clock_timestamp(), NULL,
       p.checkpoint_version, p.checkpoint_data, p.checkpoint_content_type,
       'epoch'::timestamptz + p.ttl
FROM p
WHERE EXISTS (SELECT 1 FROM leasekeeper_tasks x
              WHERE x.namespace = p.namespace AND x.task_id = p.task_id)
ORDER BY p.namespace, p.task_id
ON CONFLICT (namespace, task_id) DO UPDATE
SET (expire_time, update_time, checkpoint_version, checkpoint_data, checkpoint_content_type,
     checkpoint_fence, checkpoint_time) =
    (SELECT CASE WHEN EXCLUDED.checkpoint_time IS NULL  -- no ttl: least() would skip the NULL
                 THEN t.expire_time
                 ELSE least(c.now + (EXCLUDED.checkpoint_time - 'epoch'::timestamptz),
                            t.runtime_deadline) END,
            c.now,
            CASE WHEN w.save THEN EXCLUDED.checkpoint_version ELSE t.checkpoint_version END,
            CASE WHEN w.save THEN EXCLUDED.checkpoint_data ELSE t.checkpoint_data END,
            CASE WHEN w.save THEN EXCLUDED.checkpoint_content_type
                 ELSE t.checkpoint_content_type END,
            CASE WHEN w.save THEN t.fence ELSE t.checkpoint_fence END,
            CASE WHEN w.save THEN c.now ELSE t.checkpoint_time END
     FROM (SELECT clock_timestamp() AS now) c,
          LATERAL (SELECT coalesce(EXCLUDED.checkpoint_version > t.checkpoint_version,
                                   EXCLUDED.checkpoint_version IS NOT NULL) AS save) w)
WHERE t.owner_id = EXCLUDED.owner_id AND t.fence = EXCLUDED.fence
  AND {{lease_is_live}}
  AND t.runtime_deadline > clock_timestamp()
RETURNING {{lease_columns}}, t.checkpoint_time,
          t.checkpoint_time IS NOT DISTINCT FROM t.update_time AS checkpoint_saved,
          clock_timestamp() AS db_now;

-- name: release
-- Ends the lease of this owner and fence, live or expired (the fence matching
-- proves no newer grant exists). $5 true completes the task, $6 true ends it
-- as failed ($7 the owner's reason); a released lease of the same fence may
-- still be completed or failed by its owner. An expired lease whose ending
-- used up the task's last attempt is not released: the task is QUARANTINED
-- (as it is once the sweeper stored it), the operator's to decide.
UPDATE leasekeeper_tasks AS t
SET state = CASE WHEN $5::boolean THEN 'completed' WHEN $6::boolean THEN 'failed'
                 ELSE 'released' END,
    end_reason = CASE WHEN $5::boolean THEN 'TASK_COMPLETED' WHEN $6::boolean THEN 'TASK_FAILED'
                      ELSE 'LEASE_RELEASED' END,
    state_reason = CASE WHEN $6::boolean THEN $7::text ELSE t.state_reason END,
    expire_time = least(t.expire_time, clock_timestamp()),
    update_time = clock_timestamp()
WHERE t.namespace = $1::text AND t.task_id = $2::text
  AND t.owner_id = $3::text AND t.fence = $4::bigint
  AND ((t.state = 'held' AND ({{lease_is_live}} OR NOT {{attempt_used_up}}))
       OR (($5::boolean OR $6::boolean) AND t.state = 'released'))
RETURNING {{lease_columns}}, clock_timestamp() AS db_now;

-- name: get_leases
-- The rows of a batch of tasks ($1 namespaces, $2 task_ids: arrays, one
-- element per read, named by the unnest below; a task may be named twice),
-- each with the database clock read with it: many reads (ValidateFence,
-- GetLease, a refused claim's classification, a heartbeat's check) arriving
-- together become this one statement. A task never claimed has no row.
SELECT {{lease_columns}}, clock_timestamp() AS db_now
FROM (SELECT DISTINCT * FROM unnest($1::text[], $2::text[]) AS k(namespace, task_id)) k
JOIN leasekeeper_tasks t ON t.namespace = k.namespace AND t.task_id = k.task_id;

-- name: list_leases
-- One page of a namespace's tasks after task_id $2 (keyset): of the next $6
-- tasks by task_id (the scan's budget), those in derived state $4 ('FREE',
-- 'HELD', 'EXPIRED', 'COMPLETED'; NULL: any) and of owner $5 (NULL: any), at
-- most $3. A call reads at most $6 rows however rare its filter's matches
-- are, so its cost never follows the namespace's size. Rows come with
-- `matches` (false only for the last row read, returned so the next page can
-- start after it) and `scanned` (rows read): a page with fewer than $3
-- matches while scanned = $6 is short, not last; its next page starts after
-- the last row read. The clock is read once, in a joined one-row subquery:
-- as a column of a subquery over the table (before) it kept the subquery from
-- being flattened, and ORDER BY ... LIMIT then sorted the whole namespace
-- (a full table scan at 10^5 rows and above).
SELECT {{lease_columns}}, t.db_now, t.matches, t.scanned
FROM (
    SELECT t.*, c.db_now,
           ($5::text IS NULL OR t.owner_id = $5::text)
           AND ($4::text IS NULL OR $4::text = CASE
                WHEN t.state IN ('completed', 'cancelled', 'failed', 'quarantined')
                    THEN upper(t.state)
                WHEN t.state <> 'held' THEN 'FREE'
                WHEN {{lease_is_live:c.db_now}} THEN 'HELD'
                WHEN {{attempt_used_up}} THEN 'QUARANTINED'
                ELSE 'EXPIRED' END) AS matches,
           count(*) OVER () AS scanned,
           row_number() OVER (ORDER BY t.task_id) AS n
    FROM (SELECT clock_timestamp() AS db_now) c,
         LATERAL (SELECT * FROM leasekeeper_tasks
                  WHERE namespace = $1::text AND task_id > $2::text
                  ORDER BY task_id
                  LIMIT $6::int) t
) t
WHERE t.matches OR t.n = t.scanned
ORDER BY t.task_id
LIMIT $3::int;

-- name: list_namespaces
-- The namespaces that hold tasks after namespace $1 (keyset), by name, at
-- most $2, each with its tasks counted up to $3 (the caller asks for one
-- more than it shows: a count above its limit means "more"). A loose index
-- scan of the primary key (namespace, task_id): the recursive step descends
-- the index once to the first task of the next namespace, and a count reads
-- at most $3 index entries of one namespace, so a page's cost follows the
-- namespaces it passes and the tasks it counts, never the table's size (a
-- GROUP BY namespace would read every row). The count reads in task_id order
-- so that it walks the index: unordered, the planner may take a sequential
-- scan that stops after $3 matches, which reads the whole table for a
-- namespace stored last. Index-only where the visibility map allows.
WITH RECURSIVE ns(namespace) AS (
    (SELECT t.namespace FROM leasekeeper_tasks t
     WHERE t.namespace > $1::text
     ORDER BY t.namespace
     LIMIT 1)
    UNION ALL
    SELECT (SELECT t.namespace FROM leasekeeper_tasks t
            WHERE t.namespace > ns.namespace
            ORDER BY t.namespace
            LIMIT 1)
    FROM ns
    WHERE ns.namespace IS NOT NULL
)
SELECT ns.namespace,
       (SELECT count(*) FROM (SELECT FROM leasekeeper_tasks t
                              WHERE t.namespace = ns.namespace
                              ORDER BY t.task_id
                              LIMIT $3::int) c) AS tasks
FROM ns
WHERE ns.namespace IS NOT NULL
LIMIT $2::int;

-- name: namespace_stats
-- A namespace's figures (GetNamespaceStats; core/model.py StatsScans), read
-- at one instant (db_now, read once) in one statement. Each scan reads at
-- most $2 rows (the count limit and one more, to know there are more) of an
-- index whose rows are what it counts, in that index's order, so a call's
-- cost follows its counts (at most nine scans of $2 rows), never the
-- namespace's size or the table's. The indexes:
--   the unswept leases (migrations/0005_operations.sql): live, or expired and
--     not yet announced; judged at db_now: HELD, EXPIRED, or QUARANTINED when
--     the ending uses up the last attempt;
--   leasekeeper_tasks_expired (migrations/0009_namespace_stats.sql): rows
--     'held' whose expiry the sweeper announced (EXPIRED: when that ending
--     used up the last attempt, the sweeper stored 'quarantined' instead);
--   leasekeeper_tasks_quarantined (0009): rows 'quarantined';
--   leasekeeper_task_history_recent (0009): the GRANTED, FENCE_REFUSED,
--     EXPIRED and REVOKED entries by namespace, kind and event_time: one
--     range per kind. The kind comes from the VALUES list, so no other
--     partial index's predicate (FENCE_REFUSED's, of 0008) can be proved
--     from the query and taken instead; the IN list proves this one's. The
--     window starts $3 before db_now, given as a scalar subquery so that it
--     bounds the index scan (clock_timestamp() is volatile: compared directly
--     it would filter every entry instead);
--   leasekeeper_effects_reserved (0009): the RESERVED effects with their
--     fence, each with one lookup of its task's row by primary key (a
--     subquery per effect, never a join the planner could turn into a scan
--     of the namespace's tasks).
WITH c AS MATERIALIZED (SELECT clock_timestamp() AS db_now),
recent AS MATERIALIZED (
    SELECT k.kind, n.entries
    FROM (VALUES ('granted'), ('fence_refused'), ('expired'), ('revoked')) AS k(kind),
         LATERAL (SELECT count(*) AS entries
                  FROM (SELECT FROM leasekeeper_task_history h
                        WHERE h.namespace = $1::text AND h.kind = k.kind
                          AND h.kind IN ('granted', 'fence_refused', 'expired', 'revoked')
                          AND h.event_time > (SELECT db_now - $3::interval FROM c)
                        ORDER BY h.event_time
                        LIMIT $2::int) h) n
)
SELECT c.db_now,
       u.unswept, u.unswept_live, u.unswept_expired, u.unswept_quarantined,
       (SELECT count(*) FROM (SELECT FROM leasekeeper_tasks t
                              WHERE t.namespace = $1::text AND t.state = 'held'
                                AND t.expiry_announced_fence = t.fence
                              ORDER BY t.task_id
                              LIMIT $2::int) x) AS announced_expired,
       (SELECT count(*) FROM (SELECT FROM leasekeeper_tasks t
                              WHERE t.namespace = $1::text AND t.state = 'quarantined'
                              ORDER BY t.task_id
                              LIMIT $2::int) x) AS stored_quarantined,
       (SELECT entries FROM recent WHERE kind = 'granted') AS granted,
       (SELECT entries FROM recent WHERE kind = 'fence_refused') AS refused,
       (SELECT entries FROM recent WHERE kind = 'expired') AS expired,
       (SELECT entries FROM recent WHERE kind = 'revoked') AS revoked,
       e.reserved, e.in_doubt
FROM c,
     LATERAL (
         SELECT count(*) AS unswept,
                count(*) FILTER (WHERE {{lease_is_live:c.db_now}}) AS unswept_live,
                count(*) FILTER (WHERE NOT {{lease_is_live:c.db_now}}
                                   AND NOT {{attempt_used_up}}) AS unswept_expired,
                count(*) FILTER (WHERE NOT {{lease_is_live:c.db_now}}
                                   AND {{attempt_used_up}}) AS unswept_quarantined
         FROM (SELECT t.state, t.expire_time, t.attempts, t.max_attempts
               FROM leasekeeper_tasks t
               WHERE t.namespace = $1::text AND t.state = 'held'
                 AND t.expiry_announced_fence IS DISTINCT FROM t.fence
               ORDER BY t.task_id
               LIMIT $2::int) t
     ) u,
     LATERAL (
         SELECT count(*) AS reserved, count(*) FILTER (WHERE NOT r.live) AS in_doubt
         FROM (SELECT coalesce((SELECT t.fence = e.fence AND {{lease_is_live:c.db_now}}
                                FROM leasekeeper_tasks t
                                WHERE t.namespace = e.namespace AND t.task_id = e.task_id),
                               false) AS live
               FROM leasekeeper_effects e
               WHERE e.namespace = $1::text AND e.state = 'reserved'
               ORDER BY e.task_id, e.effect_key
               LIMIT $2::int) r
     ) e;

-- fragment: effect_answer_columns
-- The effect's record in the answer rows of begin_effect and complete_effect,
-- from the row aliased x. Its columns are prefixed e_ (storage/ledger.py
-- answered_effect) because the row also holds the task's lease, whose
-- columns share their names; the key is the caller's.
x.policy AS e_policy, x.request_digest AS e_request_digest, x.state AS e_state,
x.fence AS e_fence, x.complete_fence AS e_complete_fence, x.retryable AS e_retryable,
x.result AS e_result, x.attempts AS e_attempts, x.begin_time AS e_begin_time,
x.complete_time AS e_complete_time, x.external_operation_id AS e_external_operation_id

-- The effect ledger (storage/ledger.py). BeginEffect is statement
-- begin_effect, CompleteEffect statement complete_effect: one statement per
-- call, and so one transaction, whose writes commit when it ends or not at
-- all. Like claim and renew they take arrays, one element per call (a call
-- alone is a batch of one; the calls arriving together are one statement:
-- storage/statements.py BatchedStatement, which never puts two calls of one
-- task in a batch), and each element is decided as if alone. The rules are
-- core/effect_rules.py's (the tables of docs/guarantees.md and
-- docs/concepts/effects.md); storage/memory_ledger.py keeps the same rules,
-- held to these statements by tests/conformance.
--
-- Both decide in the same steps, each a MATERIALIZED CTE:
--   t  the tasks' rows, locked: FOR SHARE, or FOR NO KEY UPDATE for an
--      element that writes its task's row too (complete_effect with a
--      checkpoint). A claim, renewal, release, revoke or cancel of the task
--      updates the row, so it waits until the statement has committed.
--   r  the effects' records, locked FOR UPDATE, each after its task's row
--      (the lock is taken above the join with t): a statement takes a task's
--      row before its records, the rows in (namespace, task_id) order and
--      the records in key order. A locked row is read in its newest
--      committed version. A batch that meets another's lock all the same
--      waits at most the batch pool's lock timeout, then its calls are sent
--      one by one (RUN_ALONE): a lock cycle costs time, never an answer.
--   d  the database clock, read for each element after its task's row and
--      its record are held (in the target list of the join of t and r,
--      computed only once both are read), and what the rows say.
--   v  whether the caller's fence may act on that clock: it is the task's
--      fence and its lease is live ({{lease_is_live}}): core/model.py
--      fence_loss, whose reason ledger.py gives a refusal, is the same rule;
--      then the effect's rules, in each statement.
-- Then the writes, each only where v allows it, and one answer row per
-- element whose task exists: the lease and the clock (a refusal's reason is
-- read from them), may_act, and the record (e_*) as written (e_written
-- true), as found when nothing was written (false), or none (NULL).
--
-- Why an effect is done at most once (with the outside system's help, see
-- docs/concepts/effects.md):
-- * A stale fence can neither reserve nor confirm: a write is made only for
--   the task's current fence with a live lease on a clock read after the
--   statement holds the task's row, and the row stays held until the write
--   has committed, so no newer grant can come between the check and the
--   commit.
-- * Calls for one key are decided one after another, each on what the one
--   before it wrote: the record is locked before it is read. Of many
--   BeginEffect calls for a new key one inserts the record and gets PROCEED;
--   every other one finds it RESERVED (IN_DOUBT). One whose statement began
--   before that insert committed does not see the record (its snapshot is
--   older): its own insert conflicts and writes nothing (e_written NULL),
--   and ledger.py sends it again, when it finds the record.
-- * A reservation is made over a record only when the rules say PROCEED, an
--   outcome only over a RESERVED record: a confirmed ONCE outcome is never
--   replaced, and a LATEST one only by a newer fence.

-- name: begin_effect
-- BeginEffect (storage/ledger.py BeginParams: namespace, task_id, effect_key,
-- policy 'once' or 'latest', request_digest, fence). Over a record, these are
-- the rows of core/effect_rules.py decide_begin that answer PROCEED
-- (v.proceeds): the record's policy is the caller's, and either the caller
-- supersedes it (LATEST, and the fence is above both the one that reserved
-- it and the one that completed it: the digest may change), or it FAILED
-- retryable and the digest is the same.
-- Writes: the key's first record (attempts 1) where there is none (first);
-- or a new attempt over the record (again: reserved by the caller's fence
-- with its digest, attempts + 1, the outcome cleared; the policy stays, and
-- the external operation id until the attempt's outcome replaces it). Over a
-- record whose rules say otherwise nothing is written and the record is
-- answered as found: ledger.py applies decide_begin to it (IN_DOUBT,
-- ALREADY_APPLIED, or EFFECT_KEY_REUSED).
-- A new attempt never waits (the record is held since r), but a key's first
-- record can: for another transaction inserting the same key, which may roll
-- back (INSERT ... ON CONFLICT then inserts the row decided before the
-- wait). So after the writes the clock is read again, and a lease that ran
-- out meanwhile fails the statement (leasekeeper_lease_ran_out, SQLSTATE
-- LK001, migrations/0010_effect_statements.sql): nothing is reserved, the
-- batch's calls are sent one by one, and that one is answered LeaseLost.
WITH p AS MATERIALIZED (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                         $6::bigint[])
        AS p(namespace, task_id, effect_key, policy, request_digest, fence)
), t AS MATERIALIZED (
    SELECT k.* FROM leasekeeper_tasks k
    JOIN p ON k.namespace = p.namespace AND k.task_id = p.task_id
    ORDER BY k.namespace, k.task_id
    FOR SHARE OF k
), r AS MATERIALIZED (
    SELECT e.* FROM t
    JOIN p ON p.namespace = t.namespace AND p.task_id = t.task_id
    JOIN leasekeeper_effects e
      ON e.namespace = p.namespace AND e.task_id = p.task_id AND e.effect_key = p.effect_key
    ORDER BY e.namespace, e.task_id, e.effect_key
    FOR UPDATE OF e
), d AS MATERIALIZED (
    SELECT p.namespace, p.task_id, p.effect_key, clock_timestamp() AS db_now,
           r.effect_key IS NOT NULL AS found
    FROM t
    JOIN p ON p.namespace = t.namespace AND p.task_id = t.task_id
    LEFT JOIN r
      ON r.namespace = p.namespace AND r.task_id = p.task_id AND r.effect_key = p.effect_key
), v AS MATERIALIZED (
    SELECT p.*, d.db_now, d.found,
           t.fence = p.fence AND {{lease_is_live:d.db_now}} AS may_act,
           coalesce(r.policy = p.policy
                    AND ((r.policy = 'latest'
                          AND p.fence > greatest(r.fence, coalesce(r.complete_fence, 0)))
                         OR (r.state = 'failed' AND r.retryable
                             AND r.request_digest = p.request_digest)),
                    false) AS proceeds
    FROM d
    JOIN p ON p.namespace = d.namespace AND p.task_id = d.task_id
          AND p.effect_key = d.effect_key
    JOIN t ON t.namespace = d.namespace AND t.task_id = d.task_id
    LEFT JOIN r
      ON r.namespace = d.namespace AND r.task_id = d.task_id AND r.effect_key = d.effect_key
), first AS (
    INSERT INTO leasekeeper_effects
        (namespace, task_id, effect_key, policy, request_digest, state, fence,
         attempts, begin_time)
    SELECT v.namespace, v.task_id, v.effect_key, v.policy, v.request_digest, 'reserved',
           v.fence, 1, v.db_now
    FROM v
    WHERE v.may_act AND NOT v.found
    ORDER BY v.namespace, v.task_id, v.effect_key
    ON CONFLICT (namespace, task_id, effect_key) DO NOTHING
    RETURNING *
), again AS (
    UPDATE leasekeeper_effects AS e
    SET state = 'reserved', fence = v.fence, request_digest = v.request_digest,
        attempts = e.attempts + 1, begin_time = v.db_now,
        complete_fence = NULL, complete_time = NULL, retryable = false, result = ''::bytea
    FROM v
    WHERE e.namespace = v.namespace AND e.task_id = v.task_id AND e.effect_key = v.effect_key
      AND v.may_act AND v.proceeds
    RETURNING e.*
), x AS (
    SELECT first.*, true AS written FROM first
    UNION ALL
    SELECT again.*, true FROM again
    UNION ALL
    SELECT r.*, false FROM r
    WHERE NOT EXISTS (SELECT FROM first f WHERE f.namespace = r.namespace
                        AND f.task_id = r.task_id AND f.effect_key = r.effect_key)
      AND NOT EXISTS (SELECT FROM again a WHERE a.namespace = r.namespace
                        AND a.task_id = r.task_id AND a.effect_key = r.effect_key)
)
SELECT {{lease_columns}}, v.db_now, v.may_act, x.written AS e_written,
       {{effect_answer_columns}},
       CASE WHEN x.written AND NOT {{lease_is_live}}
            THEN leasekeeper_lease_ran_out(v.fence) END AS lease_ran_out
FROM v
JOIN t ON t.namespace = v.namespace AND t.task_id = v.task_id
LEFT JOIN x ON x.namespace = v.namespace AND x.task_id = v.task_id
           AND x.effect_key = v.effect_key;

-- name: complete_effect
-- CompleteEffect (storage/ledger.py CompleteParams: namespace, task_id,
-- effect_key, fence, the outcome's state 'succeeded' or 'failed', retryable,
-- result, the outside system's operation id; the version, data and content
-- type of the task's next checkpoint, all NULL without one). The rules of
-- core/effect_rules.py check_complete: over a RESERVED record the outcome is
-- written (w), completed by the caller's fence (at least the one that
-- reserved it: a replacement records what it reconciled); over a confirmed
-- one nothing is written, and ledger.py answers the record (the same outcome
-- again) or EFFECT_ALREADY_COMPLETED; with no record, EFFECT_NOT_BEGUN.
-- With a checkpoint (CompleteEffect.next_checkpoint) the outcome and the
-- checkpoint (s) are written both or neither. The checkpoint is decided as
-- statement renew decides SaveCheckpoint's: stored for the live current
-- fence with a version above the stored one; the same version, data and
-- content type stored by this fence already stand (a retry); any other
-- version refuses both (CHECKPOINT_NOT_NEWER). Its task's row is then locked
-- FOR NO KEY UPDATE from the start (t_written), since the statement writes
-- it: two such statements never both hold a share lock and wait for each
-- other to upgrade it (ledger.py sends such a call alone, never in a batch).
-- Without one, FOR SHARE (t_read): completions of one task's effects do not
-- wait for each other.
-- Nothing here waits after the clock is read (every row written is held
-- since t and r), so the clock of v is the clock of the writes. The
-- checkpoint's time is read from the outcome written (w.complete_time, the
-- same instant), so the outcome is written first and its history entry
-- comes before the checkpoint's.
WITH p AS MATERIALIZED (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[],
                         $6::boolean[], $7::bytea[], $8::text[], $9::bigint[], $10::bytea[],
                         $11::text[])
        AS p(namespace, task_id, effect_key, fence, state, retryable, result,
             external_operation_id, checkpoint_version, checkpoint_data,
             checkpoint_content_type)
), t_read AS MATERIALIZED (
    SELECT k.* FROM leasekeeper_tasks k
    JOIN p ON k.namespace = p.namespace AND k.task_id = p.task_id
    WHERE p.checkpoint_version IS NULL
    ORDER BY k.namespace, k.task_id
    FOR SHARE OF k
), t_written AS MATERIALIZED (
    SELECT k.* FROM leasekeeper_tasks k
    JOIN p ON k.namespace = p.namespace AND k.task_id = p.task_id
    WHERE p.checkpoint_version IS NOT NULL
    ORDER BY k.namespace, k.task_id
    FOR NO KEY UPDATE OF k
), t AS MATERIALIZED (
    SELECT * FROM t_read UNION ALL SELECT * FROM t_written
), r AS MATERIALIZED (
    SELECT e.* FROM t
    JOIN p ON p.namespace = t.namespace AND p.task_id = t.task_id
    JOIN leasekeeper_effects e
      ON e.namespace = p.namespace AND e.task_id = p.task_id AND e.effect_key = p.effect_key
    ORDER BY e.namespace, e.task_id, e.effect_key
    FOR UPDATE OF e
), d AS MATERIALIZED (
    SELECT p.namespace, p.task_id, p.effect_key, clock_timestamp() AS db_now,
           coalesce(r.state = 'reserved', false) AS open,
           coalesce(r.state = 'reserved'
                    OR (r.state = p.state AND r.retryable = p.retryable
                        AND r.result = p.result),
                    false) AS outcome_stands,
           coalesce(p.checkpoint_version > t.checkpoint_version,
                    p.checkpoint_version IS NOT NULL) AS checkpoint_newer,
           coalesce(p.checkpoint_version = t.checkpoint_version
                    AND t.checkpoint_fence = p.fence
                    AND t.checkpoint_data = p.checkpoint_data
                    AND t.checkpoint_content_type = p.checkpoint_content_type,
                    false) AS checkpoint_repeated
    FROM t
    JOIN p ON p.namespace = t.namespace AND p.task_id = t.task_id
    LEFT JOIN r
      ON r.namespace = p.namespace AND r.task_id = p.task_id AND r.effect_key = p.effect_key
), v AS MATERIALIZED (
    SELECT p.*, d.db_now, d.open, d.outcome_stands, d.checkpoint_newer,
           t.fence = p.fence AND {{lease_is_live:d.db_now}} AS may_act,
           p.checkpoint_version IS NULL OR d.checkpoint_newer OR d.checkpoint_repeated
               AS checkpoint_stands
    FROM d
    JOIN p ON p.namespace = d.namespace AND p.task_id = d.task_id
          AND p.effect_key = d.effect_key
    JOIN t ON t.namespace = d.namespace AND t.task_id = d.task_id
), w AS (
    UPDATE leasekeeper_effects AS e
    SET state = v.state, retryable = v.retryable, result = v.result,
        complete_fence = v.fence, complete_time = v.db_now,
        external_operation_id = v.external_operation_id
    FROM v
    WHERE e.namespace = v.namespace AND e.task_id = v.task_id AND e.effect_key = v.effect_key
      AND v.may_act AND v.open AND v.checkpoint_stands
    RETURNING e.*
), s AS (
    UPDATE leasekeeper_tasks AS k
    SET (checkpoint_version, checkpoint_data, checkpoint_content_type, checkpoint_fence,
         checkpoint_time, update_time) =
        (SELECT v.checkpoint_version, v.checkpoint_data, v.checkpoint_content_type, k.fence,
                c.at, c.at
         FROM (SELECT coalesce((SELECT w.complete_time FROM w
                                WHERE w.namespace = v.namespace AND w.task_id = v.task_id
                                  AND w.effect_key = v.effect_key),
                               v.db_now) AS at) c)
    FROM v
    WHERE k.namespace = v.namespace AND k.task_id = v.task_id
      AND v.may_act AND v.outcome_stands AND v.checkpoint_newer
    RETURNING k.namespace, k.task_id, k.checkpoint_time
), x AS (
    SELECT w.*, true AS written FROM w
    UNION ALL
    SELECT r.*, false FROM r
    WHERE NOT EXISTS (SELECT FROM w WHERE w.namespace = r.namespace
                        AND w.task_id = r.task_id AND w.effect_key = r.effect_key)
)
SELECT {{lease_columns}}, v.db_now, v.may_act, x.written AS e_written,
       {{effect_answer_columns}},
       v.checkpoint_stands, coalesce(s.checkpoint_time, t.checkpoint_time) AS checkpoint_time
FROM v
JOIN t ON t.namespace = v.namespace AND t.task_id = v.task_id
LEFT JOIN x ON x.namespace = v.namespace AND x.task_id = v.task_id
           AND x.effect_key = v.effect_key
LEFT JOIN s ON s.namespace = v.namespace AND s.task_id = v.task_id;

-- name: list_effects
-- One page of a task's effects after effect_key $3 (keyset), optionally only
-- those in state $5.
SELECT * FROM leasekeeper_effects
WHERE namespace = $1::text AND task_id = $2::text AND effect_key > $3::text
  AND ($5::text IS NULL OR state = $5::text)
ORDER BY effect_key
LIMIT $4::int;

-- name: revoke
-- An operator ends the task's lease now (live or expired), whichever fence
-- it has ($4 = 0) or only fence $4; $3 the reason. The task becomes FREE
-- (state 'revoked', claimable at once: no lock delay) and keeps its fence, so
-- the next claim gets fence + 1. No row when the task has no such lease.
-- The revoked grant counts as an attempt (migrations/0008_runs.sql); when it
-- was the last one the task becomes QUARANTINED instead of FREE. An expired
-- lease whose ending used up the last attempt is already QUARANTINED (stored
-- or not yet by the sweeper): not revoked.
UPDATE leasekeeper_tasks AS t
SET state = CASE WHEN {{attempt_used_up}} THEN 'quarantined' ELSE 'revoked' END,
    attempts = t.attempts + 1,
    end_reason = 'LEASE_REVOKED', revoke_reason = $3::text,
    expire_time = least(t.expire_time, clock_timestamp()),
    update_time = clock_timestamp()
WHERE t.namespace = $1::text AND t.task_id = $2::text AND t.state = 'held'
  AND ({{lease_is_live}} OR NOT {{attempt_used_up}})
  AND ($4::bigint = 0 OR t.fence = $4::bigint)
RETURNING {{lease_columns}}, clock_timestamp() AS db_now;

-- name: lock_limits
-- A namespace's limits and claim bucket, locked until the claim's transaction
-- ends: claims in a limited namespace take turns, so the live-lease count
-- they check cannot be raced past. No row: the namespace has no limits.
SELECT max_leases, claims_per_second,
       coalesce(claim_burst, greatest(1.0, claims_per_second)) AS burst,
       bucket_tokens, bucket_time, clock_timestamp() AS db_now
FROM leasekeeper_namespace_limits
WHERE namespace = $1::text
FOR UPDATE;

-- name: take_claim_token
-- Stores the bucket after one claim took a token ($2 tokens left at $3).
UPDATE leasekeeper_namespace_limits
SET bucket_tokens = $2::double precision, bucket_time = $3::timestamptz
WHERE namespace = $1::text;

-- name: count_live_leases
-- Live leases of namespace $1 other than task $2, counted up to $3 (the
-- limit: the count stops there), and the earliest expire_time among them.
-- Reads the index of unswept leases (migrations/0005_operations.sql) in
-- order: an ordered scan that stops at the limit is the planner's cheapest
-- path whatever it guesses of the index's size (unordered, a guess of many
-- held rows made a sequential scan "stopping early" look cheaper). The cost
-- follows the live leases, not the table.
SELECT count(*) AS live, min(expire_time) AS first_expiry, clock_timestamp() AS db_now
FROM (
    SELECT t.expire_time FROM leasekeeper_tasks t
    WHERE t.namespace = $1::text AND t.task_id <> $2::text
      AND {{lease_is_live}} AND t.expiry_announced_fence IS DISTINCT FROM t.fence
    ORDER BY t.task_id
    LIMIT $3::int
) live;

-- name: load_limits
-- Every namespace's limits, for the servers' cache.
SELECT namespace, max_leases, claims_per_second,
       coalesce(claim_burst, greatest(1.0, claims_per_second)) AS burst, lock_delay,
       max_attempts
FROM leasekeeper_namespace_limits;

-- name: sweep_expired
-- Announces expiries: marks up to $1 leases whose expire_time has passed and
-- whose expiry was not yet announced, so the task trigger sends an 'expired'
-- event for each, once. SKIP LOCKED: a row a claim or renewal is deciding is
-- left for the next sweep. The leases are found through the index of unswept
-- leases, in index order (an ordered scan with a LIMIT: the planner's
-- cheapest path whatever it guesses), and updated by the row addresses the
-- lock returned (ctid = ANY: a TID scan, never a join the planner could turn
-- into a scan of the table). A row a concurrent transaction changed after
-- this statement's snapshot is locked in its new version, which this UPDATE
-- cannot see: it is left for the next sweep.
-- An expiry that uses up the task's last attempt also stores the quarantine
-- (state 'quarantined', attempts + 1; migrations/0008_runs.sql), so it is
-- announced and lasts.
UPDATE leasekeeper_tasks AS t
SET expiry_announced_fence = t.fence,
    (state, attempts, end_reason, update_time) =
        (SELECT CASE WHEN q.used_up THEN 'quarantined' ELSE t.state END,
                t.attempts + CASE WHEN q.used_up THEN 1 ELSE 0 END,
                CASE WHEN NOT q.used_up THEN t.end_reason
                     WHEN t.expire_time >= t.runtime_deadline THEN 'RUNTIME_EXCEEDED'
                     ELSE 'LEASE_EXPIRED' END,
                CASE WHEN q.used_up THEN clock_timestamp() ELSE t.update_time END
         FROM (SELECT {{attempt_used_up}} AS used_up) q)
WHERE t.ctid = ANY (ARRAY(
    SELECT t.ctid FROM leasekeeper_tasks t
    WHERE t.state = 'held' AND t.expiry_announced_fence IS DISTINCT FROM t.fence
      AND NOT {{lease_is_live}}
    ORDER BY t.namespace, t.task_id
    LIMIT $1::int
    FOR UPDATE SKIP LOCKED))
RETURNING t.namespace, t.task_id, t.owner_id, t.fence, t.expire_time,
          t.state = 'quarantined' AS quarantined;

-- name: held_by_namespace
-- Live leases per namespace (for the leases_held gauge), from the index of
-- unswept leases.
SELECT t.namespace, count(*) AS held
FROM leasekeeper_tasks t
WHERE {{lease_is_live}} AND t.expiry_announced_fence IS DISTINCT FROM t.fence
GROUP BY t.namespace;

-- name: page_token_key
-- The key that signs page tokens (migrations/0007_page_token_key.sql); read
-- once at server start.
SELECT key FROM leasekeeper_page_token_key;

-- name: ping
-- The health check's probe, sent at every check (health.py). It takes the
-- requests' path: a pooled connection, a prepared statement, and the write
-- path of the tables calls write, so a database that answers reads but can
-- decide nothing (a privilege taken, a read-only session or standby) fails it.
-- It changes nothing: no row is selected, so no row trigger fires (there is
-- no statement trigger on these tables), and it locks what a claim locks
-- (RowExclusiveLock on the tables and their indexes). PostgreSQL checks the
-- INSERT and UPDATE privileges and read-only transactions when the statement
-- starts, row or no row.
WITH tasks AS (
    INSERT INTO leasekeeper_tasks SELECT * FROM leasekeeper_tasks WHERE false
    ON CONFLICT (namespace, task_id) DO UPDATE SET fence = leasekeeper_tasks.fence
    RETURNING 1
), effects AS (
    INSERT INTO leasekeeper_effects SELECT * FROM leasekeeper_effects WHERE false
    ON CONFLICT (namespace, task_id, effect_key) DO UPDATE SET fence = leasekeeper_effects.fence
    RETURNING 1
)
SELECT (SELECT count(*) FROM tasks) + (SELECT count(*) FROM effects) AS changed;

-- name: get_checkpoint
-- The task's checkpoint with its data (GetLease); no row when never claimed.
SELECT {{checkpoint_columns}}
FROM leasekeeper_tasks t
WHERE t.namespace = $1::text AND t.task_id = $2::text;

-- name: cancel
-- An operator cancels the task ($3 the reason): CANCELLED, terminal; its lease
-- (live or not) ends now, its checkpoint stays. No row when the task is
-- already ended (completed, failed, cancelled) or was never claimed.
UPDATE leasekeeper_tasks AS t
SET state = 'cancelled', end_reason = 'TASK_CANCELLED', state_reason = $3::text,
    expire_time = least(t.expire_time, clock_timestamp()),
    update_time = clock_timestamp()
WHERE t.namespace = $1::text AND t.task_id = $2::text
  AND t.state NOT IN ('completed', 'failed', 'cancelled')
RETURNING {{lease_columns}}, clock_timestamp() AS db_now;

-- name: retry
-- An operator puts a quarantined task back ($3 the reason): FREE (state
-- 'retried'), attempts 0; the fence is kept, so the next claim gets a higher
-- one. Quarantined is a stored 'quarantined' row, or an expired lease whose
-- ending used up the last attempt and the sweeper has not reached yet (its
-- expiry is announced by the trigger as the row changes). No row otherwise.
UPDATE leasekeeper_tasks AS t
SET state = 'retried', attempts = 0, state_reason = $3::text,
    end_reason = CASE WHEN t.state <> 'held' THEN t.end_reason
                      WHEN t.expire_time >= t.runtime_deadline THEN 'RUNTIME_EXCEEDED'
                      ELSE 'LEASE_EXPIRED' END,
    update_time = clock_timestamp()
WHERE t.namespace = $1::text AND t.task_id = $2::text
  AND (t.state = 'quarantined'
       OR (t.state = 'held' AND NOT {{lease_is_live}} AND {{attempt_used_up}}))
RETURNING {{lease_columns}}, clock_timestamp() AS db_now;

-- name: record_refusal
-- A history entry for a stale fence refused at ValidateFence or BeginEffect
-- ($5 the method): fence $3, its LossReason name $4, with the owner when $3
-- is the current fence. Only a fence the task has issued (one above it is
-- unknown, not stale: anyone could send any number), and only the first
-- refusal of each fence, reason and method, so a caller repeating a refused
-- call cannot push the task's own entries out of its kept history. Nothing
-- for a task never claimed.
INSERT INTO leasekeeper_task_history
    (namespace, task_id, event_time, kind, fence, owner_id, reason, method)
SELECT t.namespace, t.task_id, clock_timestamp(), 'fence_refused', $3::bigint,
       CASE WHEN t.fence = $3::bigint THEN t.owner_id ELSE '' END, $4::text, $5::text
FROM leasekeeper_tasks t
WHERE t.namespace = $1::text AND t.task_id = $2::text AND $3::bigint <= t.fence
  AND NOT EXISTS (SELECT 1 FROM leasekeeper_task_history h
                  WHERE h.namespace = t.namespace AND h.task_id = t.task_id
                    AND h.kind = 'fence_refused' AND h.fence = $3::bigint
                    AND h.reason = $4::text AND h.method = $5::text);

-- name: list_history
-- One page of a task's history after sequence $3 (keyset), oldest first.
SELECT * FROM leasekeeper_task_history
WHERE namespace = $1::text AND task_id = $2::text AND sequence > $3::bigint
ORDER BY sequence
LIMIT $4::int;

-- name: prune_history_age
-- Deletes up to $2 history entries older than $1 (by event_time, through its
-- index: the cost follows the entries pruned). The cutoff is read once, in a
-- subquery: clock_timestamp() is volatile, so compared directly it would be
-- a filter over the whole index instead of the index scan's bound.
DELETE FROM leasekeeper_task_history
WHERE sequence = ANY (ARRAY(
    SELECT sequence FROM leasekeeper_task_history
    WHERE event_time < (SELECT clock_timestamp() - $1::interval)
    ORDER BY event_time
    LIMIT $2::int));

-- name: prune_history_count
-- Keeps at most $1 entries per task, for the tasks of the next $2 entries
-- after the pruner's watermark (entries past it have not been checked), and
-- moves the watermark past them. The watermark row is locked SKIP LOCKED: a
-- second server finds it taken and prunes nothing. Cost: the new entries
-- read, and per task named by them at most $1 + its excess entries. An entry
-- that commits after the watermark passed its sequence is counted when its
-- task is next written (and pruned by age in any case).
WITH w AS MATERIALIZED (
    SELECT watermark FROM leasekeeper_history_pruning FOR UPDATE SKIP LOCKED
), fresh AS MATERIALIZED (
    -- The watermark as a scalar (NULL when another server holds the row:
    -- nothing is read): the primary key's range scan starts at it. Joined
    -- instead, the planner walked the whole index with a join filter.
    SELECT h.sequence, h.namespace, h.task_id
    FROM leasekeeper_task_history h
    WHERE h.sequence > (SELECT watermark FROM w)
    ORDER BY h.sequence
    LIMIT $2::int
), doomed AS (
    SELECT x.sequence
    FROM (SELECT DISTINCT namespace, task_id FROM fresh) k,
         LATERAL (SELECT h.sequence FROM leasekeeper_task_history h
                  WHERE h.namespace = k.namespace AND h.task_id = k.task_id
                  ORDER BY h.sequence DESC
                  OFFSET $1::int) x
), pruned AS (
    DELETE FROM leasekeeper_task_history
    WHERE sequence IN (SELECT sequence FROM doomed)
    RETURNING 1
), moved AS (
    UPDATE leasekeeper_history_pruning
    SET watermark = (SELECT max(sequence) FROM fresh)
    WHERE EXISTS (SELECT 1 FROM fresh)
    RETURNING 1
)
SELECT (SELECT count(*) FROM pruned) AS pruned, (SELECT count(*) FROM fresh) AS checked;

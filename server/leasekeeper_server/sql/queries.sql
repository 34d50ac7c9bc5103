-- Every statement the service runs at request time, as named blocks
-- ("-- name: NAME" starts one). store.py loads this file once.
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

-- name: claim
-- Grants the lease when the task is new, FREE or EXPIRED, or HELD by this
-- owner under another claim's request id ($6, not NULL: a new incarnation of
-- the owner, which supersedes the earlier one); returns no row when it is HELD
-- by another owner, HELD by this owner under request id $6 or with $6 NULL (a
-- retry: store.py hands the same lease back), or COMPLETED. $4 ttl, $5 runtime
-- budget, $6 request id (NULL for none; see migrations/0004_claim_request_id.sql),
-- $7 the namespace's lock delay: an expired lease (never released) keeps its
-- task unclaimable until expire_time + lock delay (zero for no delay).
-- The new row's instants come from one reading of the clock (c.now), so a ttl
-- clamped to the budget gives expire_time = runtime_deadline exactly, and an
-- expiry at that instant is recognised as RUNTIME_EXCEEDED.
-- The new fence is at least leasekeeper_fence_floor(), the floor of the
-- database's timeline (migrations/0003_fence_timeline.sql): 1, 2, 3, ... on
-- timeline 1, and above every fence of earlier timelines after a promotion,
-- so grants lost in a failover to an asynchronous standby are never reissued.
INSERT INTO leasekeeper_tasks AS t
    (namespace, task_id, owner_id, fence, state,
     expire_time, runtime_deadline, claim_time, update_time, end_reason, claim_request_id)
SELECT $1::text, $2::text, $3::text, leasekeeper_fence_floor(), 'held',
       c.now + least($4::interval, $5::interval), c.now + $5::interval,
       c.now, c.now, NULL, $6::text
FROM (SELECT clock_timestamp() AS now) c
ON CONFLICT (namespace, task_id) DO UPDATE
SET (owner_id, fence, state, expire_time, runtime_deadline, claim_time, update_time,
     end_reason, claim_request_id, revoke_reason) =
    (SELECT EXCLUDED.owner_id, greatest(t.fence + 1, leasekeeper_fence_floor()), 'held',
            c.now + least($4::interval, $5::interval), c.now + $5::interval,
            c.now, c.now, NULL, EXCLUDED.claim_request_id, NULL
     FROM (SELECT clock_timestamp() AS now) c)
WHERE t.state IN ('released', 'revoked')
   OR (t.state = 'held' AND t.expire_time + $7::interval <= clock_timestamp())
   OR (t.state = 'held' AND t.owner_id = $3::text
       AND $6::text IS NOT NULL AND t.claim_request_id IS DISTINCT FROM $6::text)
RETURNING t.namespace, t.task_id, t.owner_id, t.fence, t.state, t.expire_time,
          t.runtime_deadline, t.claim_time, t.end_reason, t.claim_request_id,
          clock_timestamp() AS db_now;

-- name: renew
-- Extends a live lease of this owner and fence; never revives an expired one
-- and never reaches past the runtime budget. $5 ttl.
-- Written as an upsert that never inserts (see the top of this file): the row
-- exists whenever the SELECT yields one (rows are never deleted), so the
-- insert always conflicts, and the conflict path locks the row before it reads
-- the clock. The inserted values only have to satisfy the table's checks.
INSERT INTO leasekeeper_tasks AS t
    (namespace, task_id, owner_id, fence, state,
     expire_time, runtime_deadline, claim_time, update_time, end_reason)
SELECT $1::text, $2::text, $3::text, $4::bigint, 'held',
       clock_timestamp(), clock_timestamp(), clock_timestamp(), clock_timestamp(), NULL
WHERE EXISTS (SELECT 1 FROM leasekeeper_tasks
              WHERE namespace = $1::text AND task_id = $2::text)
ON CONFLICT (namespace, task_id) DO UPDATE
SET expire_time = least(clock_timestamp() + $5::interval, t.runtime_deadline),
    update_time = clock_timestamp()
WHERE t.owner_id = $3::text AND t.fence = $4::bigint
  AND t.state = 'held'
  AND t.expire_time > clock_timestamp()
  AND t.runtime_deadline > clock_timestamp()
RETURNING t.namespace, t.task_id, t.owner_id, t.fence, t.state, t.expire_time,
          t.runtime_deadline, t.claim_time, t.end_reason, t.claim_request_id,
          clock_timestamp() AS db_now;

-- name: release
-- Ends the lease of this owner and fence, live or expired (the fence matching
-- proves no newer grant exists). $5 true completes the task; a released lease
-- of the same fence may still be completed by its owner.
UPDATE leasekeeper_tasks
SET state = CASE WHEN $5::boolean THEN 'completed' ELSE 'released' END,
    end_reason = CASE WHEN $5::boolean THEN 'TASK_COMPLETED' ELSE 'LEASE_RELEASED' END,
    expire_time = least(expire_time, clock_timestamp()),
    update_time = clock_timestamp()
WHERE namespace = $1::text AND task_id = $2::text
  AND owner_id = $3::text AND fence = $4::bigint
  AND (state = 'held' OR ($5::boolean AND state = 'released'))
RETURNING namespace, task_id, owner_id, fence, state, expire_time,
          runtime_deadline, claim_time, end_reason, claim_request_id,
          clock_timestamp() AS db_now;

-- name: get_task
-- The task's row and the database clock, to classify an outcome.
SELECT namespace, task_id, owner_id, fence, state, expire_time,
       runtime_deadline, claim_time, end_reason, claim_request_id, revoke_reason,
       clock_timestamp() AS db_now
FROM leasekeeper_tasks
WHERE namespace = $1::text AND task_id = $2::text;

-- name: list_tasks
-- One page of a namespace's tasks after task_id $2 (keyset), optionally only
-- those in derived state $4 ('FREE', 'HELD', 'EXPIRED', 'COMPLETED') and of
-- owner $5 (NULL: any owner).
SELECT namespace, task_id, owner_id, fence, state, expire_time,
       runtime_deadline, claim_time, end_reason, claim_request_id, revoke_reason, db_now
FROM (
    SELECT *, clock_timestamp() AS db_now
    FROM leasekeeper_tasks
    WHERE namespace = $1::text AND task_id > $2::text
) t
WHERE ($5::text IS NULL OR owner_id = $5::text)
  AND ($4::text IS NULL
   OR $4::text = CASE
        WHEN state = 'completed' THEN 'COMPLETED'
        WHEN state <> 'held' THEN 'FREE'
        WHEN expire_time > db_now THEN 'HELD'
        ELSE 'EXPIRED'
      END)
ORDER BY task_id
LIMIT $3::int;

-- The effect ledger. Each RPC is one short transaction that starts with
-- lock_lease, so the fence check and the ledger write commit together while
-- no claim can change the task (see migrations/0002_effects.sql). Waiting
-- for an effect's row lock can outlast the lease, so every later statement
-- also returns lease_live, read on the clock after its own lock or write:
-- the transaction's answer is judged by its last statement, not its first.

-- name: lock_lease
-- Takes a share lock on the task's row, then reads the row and the clock.
-- Claims, renewals and releases update the row, so they wait until the
-- transaction ends. The lock is taken inside the MATERIALIZED CTE; the clock
-- is read by the outer query only after the CTE has returned the locked row
-- (in its newest version, if a committed update was waited for).
WITH t AS MATERIALIZED (
    SELECT namespace, task_id, owner_id, fence, state, expire_time,
           runtime_deadline, claim_time, end_reason, claim_request_id
    FROM leasekeeper_tasks
    WHERE namespace = $1::text AND task_id = $2::text
    FOR SHARE
)
SELECT t.*, clock_timestamp() AS db_now FROM t;

-- name: insert_effect
-- The first reservation of an effect; no row when the key already has one
-- (after waiting for a concurrent first reservation to commit).
INSERT INTO leasekeeper_effects
    (namespace, task_id, effect_key, policy, request_digest, state, fence,
     attempts, begin_time)
VALUES ($1::text, $2::text, $3::text, $4::text, $5::bytea, 'reserved', $6::bigint,
        1, clock_timestamp())
ON CONFLICT (namespace, task_id, effect_key) DO NOTHING
RETURNING *, (SELECT t.state = 'held' AND t.expire_time > clock_timestamp()
                FROM leasekeeper_tasks t
                WHERE t.namespace = $1::text AND t.task_id = $2::text) AS lease_live;

-- name: lock_effect
-- The effect's record, locked until the transaction ends. lease_live is read
-- by the outer query, after the MATERIALIZED CTE has taken the lock.
WITH e AS MATERIALIZED (
    SELECT * FROM leasekeeper_effects
    WHERE namespace = $1::text AND task_id = $2::text AND effect_key = $3::text
    FOR UPDATE
)
SELECT e.*, (SELECT t.state = 'held' AND t.expire_time > clock_timestamp()
             FROM leasekeeper_tasks t
             WHERE t.namespace = $1::text AND t.task_id = $2::text) AS lease_live
FROM e;

-- name: reserve_effect
-- A new attempt over a locked record: for fence $5 with digest $4.
UPDATE leasekeeper_effects
SET state = 'reserved', fence = $5::bigint, request_digest = $4::bytea,
    attempts = attempts + 1, begin_time = clock_timestamp(),
    complete_fence = NULL, complete_time = NULL, retryable = false, result = ''::bytea
WHERE namespace = $1::text AND task_id = $2::text AND effect_key = $3::text
RETURNING *, (SELECT t.state = 'held' AND t.expire_time > clock_timestamp()
                FROM leasekeeper_tasks t
                WHERE t.namespace = $1::text AND t.task_id = $2::text) AS lease_live;

-- name: complete_effect
-- Records the outcome $5 ('succeeded' or 'failed') over a locked record, by fence $4.
UPDATE leasekeeper_effects
SET state = $5::text, retryable = $6::boolean, result = $7::bytea,
    complete_fence = $4::bigint, complete_time = clock_timestamp()
WHERE namespace = $1::text AND task_id = $2::text AND effect_key = $3::text
RETURNING *, (SELECT t.state = 'held' AND t.expire_time > clock_timestamp()
                FROM leasekeeper_tasks t
                WHERE t.namespace = $1::text AND t.task_id = $2::text) AS lease_live;

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
UPDATE leasekeeper_tasks
SET state = 'revoked', end_reason = 'LEASE_REVOKED', revoke_reason = $3::text,
    expire_time = least(expire_time, clock_timestamp()),
    update_time = clock_timestamp()
WHERE namespace = $1::text AND task_id = $2::text AND state = 'held'
  AND ($4::bigint = 0 OR fence = $4::bigint)
RETURNING namespace, task_id, owner_id, fence, state, expire_time,
          runtime_deadline, claim_time, end_reason, claim_request_id, revoke_reason,
          clock_timestamp() AS db_now;

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
-- Reads the index of unswept leases (migrations/0005_operations.sql): the
-- cost follows the live leases, not the table.
SELECT count(*) AS live, min(expire_time) AS first_expiry, clock_timestamp() AS db_now
FROM (
    SELECT expire_time FROM leasekeeper_tasks
    WHERE namespace = $1::text AND task_id <> $2::text
      AND state = 'held' AND expiry_announced_fence IS DISTINCT FROM fence
      AND expire_time > clock_timestamp()
    LIMIT $3::int
) live;

-- name: load_limits
-- Every namespace's limits, for the servers' cache.
SELECT namespace, max_leases, claims_per_second,
       coalesce(claim_burst, greatest(1.0, claims_per_second)) AS burst, lock_delay
FROM leasekeeper_namespace_limits;

-- name: sweep_expired
-- Announces expiries: marks up to $1 leases whose expire_time has passed
-- and whose expiry was not yet announced, so the task trigger sends an
-- 'expired' event for each, once. SKIP LOCKED: a row a claim or renewal is
-- deciding is left for the next sweep. Reads the index of unswept leases, so
-- the cost follows the live and newly expired leases, not the table.
UPDATE leasekeeper_tasks AS t
SET expiry_announced_fence = t.fence
FROM (
    SELECT namespace, task_id FROM leasekeeper_tasks
    WHERE state = 'held' AND expiry_announced_fence IS DISTINCT FROM fence
      AND expire_time <= clock_timestamp()
    LIMIT $1::int
    FOR UPDATE SKIP LOCKED
) e
WHERE t.namespace = e.namespace AND t.task_id = e.task_id
RETURNING t.namespace, t.task_id, t.owner_id, t.fence, t.expire_time;

-- name: held_by_namespace
-- Live leases per namespace (for the leases_held gauge), from the index of
-- unswept leases.
SELECT namespace, count(*) AS held
FROM leasekeeper_tasks
WHERE state = 'held' AND expiry_announced_fence IS DISTINCT FROM fence
  AND expire_time > clock_timestamp()
GROUP BY namespace;

-- name: ping
SELECT 1;

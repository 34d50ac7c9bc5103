-- Every statement the service runs at request time, as named blocks
-- ("-- name: NAME" starts one). store.py loads this file once.
--
-- Each decision is one statement that reads the database clock itself with
-- clock_timestamp(), never now(): now() is frozen at the start of the
-- transaction, so a statement that waited on a row lock would judge with a
-- stale instant. In an UPDATE (and in ON CONFLICT DO UPDATE) the WHERE clause
-- is evaluated again on the newest row version once the lock is granted, so
-- the clock it reads is the clock at the moment the row is decided.
-- Every statement returns clock_timestamp() AS db_now, the instant the answer
-- describes; remaining ttls are expire_time - db_now.

-- name: claim
-- Grants the lease when the task is new, FREE or EXPIRED; returns no row when
-- it is HELD (by anyone) or COMPLETED. $4 ttl, $5 runtime budget.
INSERT INTO leasekeeper_tasks AS t
    (namespace, task_id, owner_id, fence, state,
     expire_time, runtime_deadline, claim_time, update_time, end_reason)
VALUES ($1::text, $2::text, $3::text, 1, 'held',
        clock_timestamp() + least($4::interval, $5::interval),
        clock_timestamp() + $5::interval,
        clock_timestamp(), clock_timestamp(), NULL)
ON CONFLICT (namespace, task_id) DO UPDATE
SET owner_id = EXCLUDED.owner_id,
    fence = t.fence + 1,
    state = 'held',
    expire_time = clock_timestamp() + least($4::interval, $5::interval),
    runtime_deadline = clock_timestamp() + $5::interval,
    claim_time = clock_timestamp(),
    update_time = clock_timestamp(),
    end_reason = NULL
WHERE t.state IN ('released', 'revoked')
   OR (t.state = 'held' AND t.expire_time <= clock_timestamp())
RETURNING t.namespace, t.task_id, t.owner_id, t.fence, t.state, t.expire_time,
          t.runtime_deadline, t.claim_time, t.end_reason, clock_timestamp() AS db_now;

-- name: renew
-- Extends a live lease of this owner and fence; never revives an expired one
-- and never reaches past the runtime budget. $5 ttl.
UPDATE leasekeeper_tasks
SET expire_time = least(clock_timestamp() + $5::interval, runtime_deadline),
    update_time = clock_timestamp()
WHERE namespace = $1::text AND task_id = $2::text
  AND owner_id = $3::text AND fence = $4::bigint
  AND state = 'held'
  AND expire_time > clock_timestamp()
  AND runtime_deadline > clock_timestamp()
RETURNING namespace, task_id, owner_id, fence, state, expire_time,
          runtime_deadline, claim_time, end_reason, clock_timestamp() AS db_now;

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
          runtime_deadline, claim_time, end_reason, clock_timestamp() AS db_now;

-- name: get_task
-- The task's row and the database clock, to classify an outcome.
SELECT namespace, task_id, owner_id, fence, state, expire_time,
       runtime_deadline, claim_time, end_reason, clock_timestamp() AS db_now
FROM leasekeeper_tasks
WHERE namespace = $1::text AND task_id = $2::text;

-- name: list_tasks
-- One page of a namespace's tasks after task_id $2 (keyset), optionally only
-- those in derived state $4 ('FREE', 'HELD', 'EXPIRED', 'COMPLETED').
SELECT namespace, task_id, owner_id, fence, state, expire_time,
       runtime_deadline, claim_time, end_reason, db_now
FROM (
    SELECT *, clock_timestamp() AS db_now
    FROM leasekeeper_tasks
    WHERE namespace = $1::text AND task_id > $2::text
) t
WHERE $4::text IS NULL
   OR $4::text = CASE
        WHEN state = 'completed' THEN 'COMPLETED'
        WHEN state <> 'held' THEN 'FREE'
        WHEN expire_time > db_now THEN 'HELD'
        ELSE 'EXPIRED'
      END
ORDER BY task_id
LIMIT $3::int;

-- name: ping
SELECT 1;

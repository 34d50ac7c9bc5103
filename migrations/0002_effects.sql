-- The effect ledger: one row per (namespace, task_id, effect_key), the
-- caller's idempotency key for one side effect of a task.
--
-- A row is written only in a transaction that holds a share lock on the
-- task's row and has checked, on clock_timestamp() read after that lock, that
-- the caller's fence is the task's current fence and its lease is live. A
-- claim (which must update the task row) therefore waits for the reservation
-- to commit, and a reservation can never be made under a fence that a newer
-- grant has already replaced.
--
-- state:
--   'reserved'   an attempt was reserved by `fence`; its outcome is unknown
--                (it may have happened): the next BeginEffect is IN_DOUBT
--   'succeeded'  confirmed done; `result` is what the outside system said
--   'failed'     confirmed not done; `retryable` says whether a new attempt
--                may be reserved
-- Rows are never deleted while their task exists: they are the memory that
-- stops a replacement worker from repeating an effect.
CREATE TABLE leasekeeper_effects (
    namespace      text COLLATE "C" NOT NULL,
    task_id        text COLLATE "C" NOT NULL,
    effect_key     text COLLATE "C" NOT NULL,
    policy         text NOT NULL CHECK (policy IN ('once', 'latest')),
    request_digest bytea NOT NULL,
    state          text NOT NULL CHECK (state IN ('reserved', 'succeeded', 'failed')),
    -- The fence of the latest reservation.
    fence          bigint NOT NULL CHECK (fence >= 1),
    -- The fence that recorded the outcome; NULL while reserved.
    complete_fence bigint CHECK (complete_fence >= fence),
    retryable      boolean NOT NULL DEFAULT false,
    result         bytea NOT NULL DEFAULT ''::bytea,
    attempts       integer NOT NULL CHECK (attempts >= 1),
    begin_time     timestamptz NOT NULL,
    complete_time  timestamptz,
    PRIMARY KEY (namespace, task_id, effect_key),
    FOREIGN KEY (namespace, task_id) REFERENCES leasekeeper_tasks (namespace, task_id),
    CHECK ((state = 'reserved') = (complete_fence IS NULL)),
    CHECK ((state = 'reserved') = (complete_time IS NULL)),
    CHECK (state = 'failed' OR NOT retryable)
) WITH (fillfactor = 80);

-- Runs that survive their workers: a checkpoint per task, attempts with a
-- quarantine stop, cancellation, a failed disposition, and the task's history.
--
-- Row states (column state), old and new, and the task state each one is
-- (core/model.py judges a row with its db_now; list_leases' CASE the same):
--   held         HELD while expire_time > db_now; after that EXPIRED, or
--                QUARANTINED when attempts + 1 >= max_attempts (the ending
--                lease uses up the last attempt)
--   released     FREE                  revoked    FREE
--   retried      FREE (an operator put a quarantined task back; attempts 0)
--   quarantined  QUARANTINED: attempts used up; claims refused until Retry
--   completed    COMPLETED (terminal)  failed     FAILED (terminal)
--   cancelled    CANCELLED (terminal)
--
-- attempts counts the grants that ended without a release and were recorded
-- as ended: a claim that takes over an expired lease adds 1 (a new incarnation
-- of the owner superseding a live lease does not), a revoke adds 1, the sweeper adds 1
-- when the lease it announces expired uses up the last attempt (and stores
-- 'quarantined'). An expired lease not yet taken over is counted when read
-- (core/model.py Lease.attempts). Retry sets it to 0.
--
-- max_attempts is the limit the current grant carries (its claim's, or the
-- namespace's default); NULL: none.
--
-- The checkpoint columns hold one checkpoint per task, the latest; only the
-- owner of the live current fence writes it, with a higher version
-- (statement renew; sql/queries.sql). Nothing clears it.
ALTER TABLE leasekeeper_tasks DROP CONSTRAINT leasekeeper_tasks_state_check;
ALTER TABLE leasekeeper_tasks ADD CONSTRAINT leasekeeper_tasks_state_check
    CHECK (state IN ('held', 'released', 'revoked', 'completed',
                     'retried', 'quarantined', 'cancelled', 'failed'));

ALTER TABLE leasekeeper_tasks
    ADD COLUMN attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    ADD COLUMN max_attempts integer CHECK (max_attempts >= 1),
    -- The words of the last cancel, fail or retry (Lease.cancel_reason,
    -- Lease.fail_reason); a claim clears it, like revoke_reason.
    ADD COLUMN state_reason text,
    ADD COLUMN checkpoint_version bigint CHECK (checkpoint_version >= 1),
    ADD COLUMN checkpoint_data bytea,
    ADD COLUMN checkpoint_content_type text,
    ADD COLUMN checkpoint_fence bigint,
    ADD COLUMN checkpoint_time timestamptz;

ALTER TABLE leasekeeper_namespace_limits
    ADD COLUMN max_attempts integer CHECK (max_attempts >= 1);

ALTER TABLE leasekeeper_effects
    ADD COLUMN external_operation_id text NOT NULL DEFAULT '';

-- The history of every task, oldest first by sequence. Written by the
-- triggers below (so every statement that changes a task or an effect writes
-- its entry in its own transaction, and no statement can forget to), and by
-- statement record_refusal for stale fences refused at ValidateFence and
-- BeginEffect. Pruned in the background (storage/pruner.py): by age through
-- the event_time index, and by count per task for the tasks written since the
-- pruner's watermark.
CREATE TABLE leasekeeper_task_history (
    sequence              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    namespace             text COLLATE "C" NOT NULL,
    task_id               text COLLATE "C" NOT NULL,
    event_time            timestamptz NOT NULL,
    kind                  text NOT NULL CHECK (kind IN (
                              'granted', 'released', 'expired', 'revoked', 'completed',
                              'failed', 'cancelled', 'quarantined', 'retried',
                              'checkpoint_saved', 'effect_reserved', 'effect_completed',
                              'fence_refused')),
    fence                 bigint NOT NULL DEFAULT 0,
    owner_id              text NOT NULL DEFAULT '',
    attempt               integer NOT NULL DEFAULT 0,
    checkpoint_version    bigint NOT NULL DEFAULT 0,
    checkpoint_size       bigint NOT NULL DEFAULT 0,
    effect_key            text NOT NULL DEFAULT '',
    effect_outcome        text NOT NULL DEFAULT '',
    external_operation_id text NOT NULL DEFAULT '',
    reason                text NOT NULL DEFAULT '',
    method                text NOT NULL DEFAULT ''
);
CREATE INDEX leasekeeper_task_history_task
    ON leasekeeper_task_history (namespace, task_id, sequence);
CREATE INDEX leasekeeper_task_history_age ON leasekeeper_task_history (event_time);
-- The refusals of a task's fences: record_refusal writes each fence, reason
-- and method once, and finds the earlier one here without reading the
-- task's other entries (partial: only refusal entries are in it).
CREATE INDEX leasekeeper_task_history_refused
    ON leasekeeper_task_history (namespace, task_id, fence) WHERE kind = 'fence_refused';

-- The count pruner's progress: entries up to this sequence have had their
-- task's count checked. One row; a pruner locks it (SKIP LOCKED), so one
-- server prunes at a time.
CREATE TABLE leasekeeper_history_pruning (
    only_row  boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    watermark bigint NOT NULL
);
INSERT INTO leasekeeper_history_pruning (watermark) VALUES (0);

-- The notification payload carries the new columns (Watch shows them), never
-- the checkpoint's data (a payload is at most 8000 bytes); for a grant that
-- followed an ended lease, that lease's end (previous_end: the time in
-- recovery is claim_time - previous_end); for a revoke or cancel, whether it
-- ended a live lease (ended_live; storage/sweeper.py counts lost leases by it).
DROP FUNCTION leasekeeper_notify_row(text, timestamptz, leasekeeper_tasks);
CREATE FUNCTION leasekeeper_notify_row(event text, event_time timestamptz,
                                       r leasekeeper_tasks,
                                       previous_end timestamptz DEFAULT NULL,
                                       ended_live boolean DEFAULT NULL) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify(
        'leasekeeper_lease',
        json_build_object(
            'event', event,
            'event_time', event_time,
            'namespace', r.namespace,
            'task_id', r.task_id,
            'owner_id', r.owner_id,
            'fence', r.fence,
            'state', r.state,
            'expire_time', r.expire_time,
            'runtime_deadline', r.runtime_deadline,
            'claim_time', r.claim_time,
            'end_reason', r.end_reason,
            'claim_request_id', r.claim_request_id,
            'revoke_reason', r.revoke_reason,
            'attempts', r.attempts,
            'max_attempts', r.max_attempts,
            'state_reason', r.state_reason,
            'checkpoint_version', r.checkpoint_version,
            'checkpoint_size', octet_length(r.checkpoint_data),
            'previous_end', previous_end,
            'ended_live', ended_live
        )::text
    )
$$;

-- One event of a task: announced to watchers and written to its history.
CREATE FUNCTION leasekeeper_task_event(event text, event_time timestamptz,
                                       r leasekeeper_tasks,
                                       previous_end timestamptz DEFAULT NULL,
                                       ended_live boolean DEFAULT NULL) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM leasekeeper_notify_row(event, event_time, r, previous_end, ended_live);
    INSERT INTO leasekeeper_task_history
        (namespace, task_id, event_time, kind, fence, owner_id, attempt, reason)
    VALUES (r.namespace, r.task_id, event_time,
            CASE event WHEN 'claimed' THEN 'granted' ELSE event END,
            r.fence, r.owner_id,
            CASE event WHEN 'claimed' THEN r.attempts + 1
                       WHEN 'quarantined' THEN r.attempts ELSE 0 END,
            CASE event
                WHEN 'expired' THEN CASE WHEN r.expire_time >= r.runtime_deadline
                                         THEN 'RUNTIME_EXCEEDED' ELSE 'LEASE_EXPIRED' END
                WHEN 'revoked' THEN coalesce(r.revoke_reason, '')
                WHEN 'quarantined' THEN coalesce(r.end_reason, '')
                ELSE coalesce(r.state_reason, '')
            END);
END;
$$;

-- As 0006, through leasekeeper_task_event, and a checkpoint write is a
-- history entry (not a Watch event).
CREATE OR REPLACE FUNCTION leasekeeper_notify_lease() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.state = 'held'
       AND (NEW.fence IS DISTINCT FROM OLD.fence OR NEW.state IS DISTINCT FROM OLD.state)
       AND OLD.expire_time <= NEW.update_time
       AND OLD.expiry_announced_fence IS DISTINCT FROM OLD.fence THEN
        PERFORM leasekeeper_task_event('expired', OLD.expire_time, OLD);
    END IF;
    IF TG_OP = 'INSERT' THEN
        PERFORM leasekeeper_task_event('claimed', NEW.claim_time, NEW);
    ELSIF NEW.fence IS DISTINCT FROM OLD.fence THEN
        PERFORM leasekeeper_task_event(
            'claimed', NEW.claim_time, NEW,
            CASE WHEN OLD.state <> 'held' OR OLD.expire_time <= NEW.claim_time
                 THEN OLD.expire_time END);
    ELSIF NEW.state IS DISTINCT FROM OLD.state THEN
        IF NEW.state = 'quarantined' AND NEW.end_reason = 'LEASE_REVOKED' THEN
            PERFORM leasekeeper_task_event('revoked', NEW.update_time, NEW, NULL,
                                           OLD.expire_time > NEW.update_time);
        END IF;
        PERFORM leasekeeper_task_event(
            NEW.state, NEW.update_time, NEW, NULL,
            OLD.state = 'held' AND OLD.expire_time > NEW.update_time);
    ELSIF NEW.owner_id IS DISTINCT FROM OLD.owner_id THEN
        PERFORM leasekeeper_task_event('claimed', NEW.claim_time, NEW);
    ELSIF NEW.expiry_announced_fence IS DISTINCT FROM OLD.expiry_announced_fence
          AND NEW.expiry_announced_fence = NEW.fence THEN
        PERFORM leasekeeper_task_event('expired', NEW.expire_time, NEW);
    END IF;
    IF NEW.checkpoint_version IS DISTINCT FROM
       (CASE WHEN TG_OP = 'UPDATE' THEN OLD.checkpoint_version END) THEN
        INSERT INTO leasekeeper_task_history
            (namespace, task_id, event_time, kind, fence, owner_id,
             checkpoint_version, checkpoint_size)
        VALUES (NEW.namespace, NEW.task_id, NEW.checkpoint_time, 'checkpoint_saved',
                NEW.checkpoint_fence, NEW.owner_id, NEW.checkpoint_version,
                coalesce(octet_length(NEW.checkpoint_data), 0));
    END IF;
    RETURN NULL;
END;
$$;

-- Effect reservations and outcomes, as history entries.
CREATE FUNCTION leasekeeper_effect_history() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'reserved'
       AND (TG_OP = 'INSERT' OR OLD.state <> 'reserved' OR NEW.attempts <> OLD.attempts
            OR NEW.fence <> OLD.fence) THEN
        INSERT INTO leasekeeper_task_history
            (namespace, task_id, event_time, kind, fence, attempt, effect_key)
        VALUES (NEW.namespace, NEW.task_id, NEW.begin_time, 'effect_reserved', NEW.fence,
                NEW.attempts, NEW.effect_key);
    ELSIF NEW.state <> 'reserved' AND (TG_OP = 'INSERT' OR OLD.state = 'reserved') THEN
        INSERT INTO leasekeeper_task_history
            (namespace, task_id, event_time, kind, fence, attempt, effect_key, effect_outcome,
             external_operation_id)
        VALUES (NEW.namespace, NEW.task_id, NEW.complete_time, 'effect_completed',
                NEW.complete_fence, NEW.attempts, NEW.effect_key, NEW.state,
                NEW.external_operation_id);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER leasekeeper_effects_history
    AFTER INSERT OR UPDATE ON leasekeeper_effects
    FOR EACH ROW EXECUTE FUNCTION leasekeeper_effect_history();

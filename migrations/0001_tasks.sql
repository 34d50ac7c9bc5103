-- The task table: one row per (namespace, task_id), created by its first claim
-- and never deleted, because it carries the task's fence counter.
--
-- state holds what the last transition left; whether a 'held' lease is live
-- is decided when asked, by comparing expire_time with clock_timestamp():
--   'held'      + expire_time >  clock  -> HELD
--   'held'      + expire_time <= clock  -> EXPIRED (claimable; lost for all else)
--   'released' / 'revoked'              -> FREE
--   'completed'                         -> COMPLETED (terminal)
-- owner_id is the owner of the current fence (the last owner once FREE), so a
-- release repeated by that owner with that fence can be recognised.
--
-- Ids compare byte for byte (COLLATE "C"), so ordering and equality never
-- depend on the database's locale. fillfactor leaves room on each page for
-- HOT updates: renewals rewrite the row but no indexed column.
CREATE TABLE leasekeeper_tasks (
    namespace        text COLLATE "C" NOT NULL,
    task_id          text COLLATE "C" NOT NULL,
    owner_id         text COLLATE "C" NOT NULL,
    fence            bigint NOT NULL CHECK (fence >= 1),
    state            text NOT NULL CHECK (state IN ('held', 'released', 'revoked', 'completed')),
    expire_time      timestamptz NOT NULL,
    runtime_deadline timestamptz NOT NULL,
    claim_time       timestamptz NOT NULL,
    update_time      timestamptz NOT NULL,
    -- Why the lease of the current fence ended, when it did by a transition
    -- (released, revoked, completed); expiry needs no write.
    end_reason       text,
    PRIMARY KEY (namespace, task_id)
) WITH (fillfactor = 70);

-- Pushes every change of ownership to the servers' heartbeat streams
-- (LISTEN leasekeeper_lease). A renewal, which changes only expire_time, is
-- not news to anyone and sends nothing.
CREATE FUNCTION leasekeeper_notify_lease() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT'
       OR NEW.fence IS DISTINCT FROM OLD.fence
       OR NEW.state IS DISTINCT FROM OLD.state
       OR NEW.owner_id IS DISTINCT FROM OLD.owner_id THEN
        PERFORM pg_notify(
            'leasekeeper_lease',
            json_build_object(
                'namespace', NEW.namespace,
                'task_id', NEW.task_id,
                'fence', NEW.fence,
                'state', NEW.state
            )::text
        );
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER leasekeeper_tasks_notify
    AFTER INSERT OR UPDATE ON leasekeeper_tasks
    FOR EACH ROW EXECUTE FUNCTION leasekeeper_notify_lease();

-- What running leasekeeper as shared infrastructure needs in the database:
-- revokes, announced expiries, per-namespace limits and access tokens.

-- Revoke (an operator's call) sets state 'revoked' and records why; the next
-- claim clears it.
ALTER TABLE leasekeeper_tasks ADD COLUMN revoke_reason text;

-- The fence whose expiry the sweeper has announced (TASK_EVENT_TYPE_EXPIRED).
-- Expiry itself needs no write; this column only makes the announcement
-- happen once per lease, whichever replica sweeps.
ALTER TABLE leasekeeper_tasks ADD COLUMN expiry_announced_fence bigint;

-- The leases that are live, or expired but not yet announced: what the sweeper
-- reads and what a namespace's live-lease limit counts, so both cost what the
-- live leases number, not what the table holds. Renewals change none of the
-- columns this index names (its predicate included), so they stay HOT updates.
CREATE INDEX leasekeeper_tasks_unswept ON leasekeeper_tasks (namespace, task_id)
    WHERE state = 'held' AND expiry_announced_fence IS DISTINCT FROM fence;

-- Every change of ownership is announced on channel leasekeeper_lease with the
-- row as the change left it and what happened ('event'):
--   claimed    a new row, or a new fence
--   released / completed / revoked   the state changed to it
--   expired    the lease's expire_time passed unrenewed: announced by the
--              sweeper (it marks the fence in expiry_announced_fence), or, for
--              a lease granted again before the sweeper came by, by that
--              claim, just before its own 'claimed' (so every expiry is
--              announced once, whichever comes first)
-- 'event_time' is the instant of the change on the database clock: the
-- grant's claim_time, the expire_time for 'expired', else the update_time the
-- release, revoke or completion wrote. A renewal, which changes only
-- expire_time and update_time, is not news to anyone and sends nothing. A
-- payload stays far below PostgreSQL's 8000-byte limit: ids are at most 1024
-- bytes each (settings.py) and a revoke reason at most 1024.
CREATE FUNCTION leasekeeper_notify_row(event text, event_time timestamptz,
                                       r leasekeeper_tasks) RETURNS void
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
            'revoke_reason', r.revoke_reason
        )::text
    )
$$;

CREATE OR REPLACE FUNCTION leasekeeper_notify_lease() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence THEN
        -- A claim that took over an expired lease nobody announced yet.
        IF TG_OP = 'UPDATE' AND OLD.state = 'held' AND OLD.expire_time <= NEW.claim_time
           AND OLD.expiry_announced_fence IS DISTINCT FROM OLD.fence THEN
            PERFORM leasekeeper_notify_row('expired', OLD.expire_time, OLD);
        END IF;
        PERFORM leasekeeper_notify_row('claimed', NEW.claim_time, NEW);
    ELSIF NEW.state IS DISTINCT FROM OLD.state THEN
        -- released, completed, revoked
        PERFORM leasekeeper_notify_row(NEW.state, NEW.update_time, NEW);
    ELSIF NEW.owner_id IS DISTINCT FROM OLD.owner_id THEN
        PERFORM leasekeeper_notify_row('claimed', NEW.claim_time, NEW);
    ELSIF NEW.expiry_announced_fence IS DISTINCT FROM OLD.expiry_announced_fence
          AND NEW.expiry_announced_fence = NEW.fence THEN
        PERFORM leasekeeper_notify_row('expired', NEW.expire_time, NEW);
    END IF;
    RETURN NULL;
END;
$$;

-- Per-namespace limits, set by operators (`leasekeeper limits set`). A
-- namespace without a row has no limits and no lock delay.
--   max_leases         most live leases at once (NULL: no limit)
--   claims_per_second  token bucket refill rate for Claim calls (NULL: no limit)
--   claim_burst        the bucket's size (NULL: max(1, claims_per_second))
--   lock_delay         after a lease expires without a release, how long the
--                      task stays unclaimable (Chubby's and Consul's lock-delay)
--   bucket_tokens / bucket_time  the bucket's state, written by claims
CREATE TABLE leasekeeper_namespace_limits (
    namespace         text COLLATE "C" PRIMARY KEY,
    max_leases        integer CHECK (max_leases >= 0),
    claims_per_second double precision CHECK (claims_per_second > 0),
    claim_burst       double precision CHECK (claim_burst >= 1),
    lock_delay        interval NOT NULL DEFAULT '0' CHECK (lock_delay >= interval '0'),
    bucket_tokens     double precision,
    bucket_time       timestamptz,
    update_time       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Access tokens kept in the database (`leasekeeper tokens create`). Only a
-- SHA-256 digest of each token is stored: tokens are 256-bit random secrets,
-- so a fast digest is enough (no password hashing needed), and the table
-- leaking does not leak them. token_id is the public part of the token, shown
-- in lists and logs.
CREATE TABLE leasekeeper_tokens (
    token_id     text COLLATE "C" PRIMARY KEY,
    token_sha256 bytea NOT NULL UNIQUE,
    name         text NOT NULL,
    role         text NOT NULL CHECK (role IN ('worker', 'effect', 'admin')),
    namespaces   text[] NOT NULL,
    create_time  timestamptz NOT NULL DEFAULT clock_timestamp(),
    expire_time  timestamptz,
    revoke_time  timestamptz
);

-- Servers cache limits and tokens; a change is announced on channel
-- leasekeeper_config ('limits' or 'tokens') so every replica reloads at once.
CREATE FUNCTION leasekeeper_notify_config() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- A claim updating only its namespace's bucket is not a change of limits.
    -- (Nested: PL/pgSQL plans a condition as a whole, and NEW of the tokens
    -- table has no max_leases.)
    IF TG_TABLE_NAME = 'leasekeeper_namespace_limits' AND TG_OP = 'UPDATE' THEN
        IF (NEW.max_leases, NEW.claims_per_second, NEW.claim_burst, NEW.lock_delay)
           IS NOT DISTINCT FROM
           (OLD.max_leases, OLD.claims_per_second, OLD.claim_burst, OLD.lock_delay) THEN
            RETURN NULL;
        END IF;
    END IF;
    PERFORM pg_notify('leasekeeper_config', TG_ARGV[0]);
    RETURN NULL;
END;
$$;

CREATE TRIGGER leasekeeper_namespace_limits_notify
    AFTER INSERT OR UPDATE OR DELETE ON leasekeeper_namespace_limits
    FOR EACH ROW EXECUTE FUNCTION leasekeeper_notify_config('limits');

CREATE TRIGGER leasekeeper_tokens_notify
    AFTER INSERT OR UPDATE OR DELETE ON leasekeeper_tokens
    FOR EACH ROW EXECUTE FUNCTION leasekeeper_notify_config('tokens');

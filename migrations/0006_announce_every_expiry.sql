-- Every expiry is announced once, whichever change comes after it.
--
-- Before: only a claim that took over an expired lease the sweeper had not
-- reached announced that expiry itself (0005). A release, a completion or a
-- revoke of such a lease (allowed: the owner releases after it gave up the
-- lease, an operator revokes) left the state 'held' and so the sweeper's
-- view, and the expiry went unannounced: Watch showed CLAIMED then RELEASED,
-- and the leases_expired metric and the audit log, fed from the same
-- announcements, missed it.
--
-- Now any change that ends the old lease's row state or fence (a claim, a
-- release, a completion, a revoke) first announces 'expired' for the old row
-- when that lease had expired unannounced at the change's instant
-- (update_time: every such statement writes it, a claim as its claim_time).
-- The sweeper marks expiry_announced_fence and only reads rows in state
-- 'held', so whoever comes first announces, and the other finds nothing to
-- announce. Calls that find the lease lost (a renewal, a heartbeat, an
-- effect, ValidateFence) write nothing and announce nothing: the expiry is
-- announced by the sweeper, or by the change that ends the lease.
CREATE OR REPLACE FUNCTION leasekeeper_notify_lease() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.state = 'held'
       AND (NEW.fence IS DISTINCT FROM OLD.fence OR NEW.state IS DISTINCT FROM OLD.state)
       AND OLD.expire_time <= NEW.update_time
       AND OLD.expiry_announced_fence IS DISTINCT FROM OLD.fence THEN
        PERFORM leasekeeper_notify_row('expired', OLD.expire_time, OLD);
    END IF;
    IF TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence THEN
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

-- Fences that survive a failover: the PostgreSQL timeline is folded into them.
--
-- A task's fence counter lives in its row, so it is exactly as durable as the
-- database's commits. A failover to an asynchronous standby can lose the
-- newest commits: grants acknowledged by the old primary whose WAL never
-- reached the standby. The standby's row then holds a lower fence, and
-- "fence + 1" would hand a number already given to another owner once more.
--
-- Every promotion (and every end of archive recovery, as after a
-- point-in-time restore) starts a new timeline, numbered above the one it
-- forks from. A claim grants at least the floor of the current timeline:
--
--     floor(timeline) = (timeline - 1) * 2^40 + 1
--     new fence       = greatest(previous fence + 1, floor(timeline))
--
-- On timeline 1 the floor is 1, so fences are 1, 2, 3, ... as always. On
-- timeline n every fence is above every fence timeline n-1 or earlier could
-- have handed out, lost or not, provided no task had 2^40 (about 10^12)
-- grants on one timeline; fences stay below 2^53 (exact in a JSON number)
-- up to timeline 8192, and int64 holds timelines below 2^23.
--
-- The timeline is read from the name of the current WAL file, whose first 8
-- hex digits are the timeline the server inserts WAL on (PostgreSQL 15+:
-- GetWALInsertionTimeLine(); 13 and 14: the backend's ThisTimeLineID, which
-- pg_walfile_name() refreshes through RecoveryInProgress()). That value is
-- the new timeline from the moment a promoted server accepts writes. Not
-- pg_control_checkpoint().timeline_id: it names the timeline of the last
-- checkpoint, and stays the old one after a promotion until the first
-- checkpoint on the new timeline completes (observed: about 0.3 s, during
-- which claims are already accepted).
--
-- Both functions are plain SQL expressions, inlined into the claim statement
-- by the planner; they are VOLATILE because the timeline changes under a
-- running server. On a standby they fail ("recovery is in progress"), but a
-- claim never gets that far there: a read-only transaction refuses the
-- INSERT before it evaluates anything.

CREATE FUNCTION leasekeeper_timeline() RETURNS bigint
LANGUAGE sql VOLATILE
AS $$
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint
$$;

COMMENT ON FUNCTION leasekeeper_timeline() IS
    'The timeline this primary writes its WAL on (1 until the first promotion or archive recovery).';

CREATE FUNCTION leasekeeper_fence_floor() RETURNS bigint
LANGUAGE sql VOLATILE
AS $$
    SELECT (leasekeeper_timeline() - 1) * 1099511627776 + 1  -- 2^40 fences per timeline
$$;

COMMENT ON FUNCTION leasekeeper_fence_floor() IS
    'The lowest fence a claim may grant on the current timeline: (timeline - 1) * 2^40 + 1.';

"""The history workload's own tables, beside the service's (test-only, never in migrations/).

* ``history_task_versions``: every version of every ``leasekeeper_tasks`` row
  of a workload's namespace, written by an AFTER trigger in the same
  transaction as the change, so it is exactly as durable as the change itself.
  It is the database's record of who held what, when (database clock), of
  each task's attempts and of every checkpoint write (version, fence, time,
  data): the checker compares what workers and the operator were told
  against it.
* ``history_applies``: the outside system the workers' effects act on. Each
  apply is one transaction that first accepts the worker's fence in
  ``leasekeeper_accepted_fences`` (:mod:`leasekeeper.fence_table`), so a
  stale fence is refused at the effect boundary, and then records the apply
  with the database's clock.
"""

from __future__ import annotations

import asyncpg

from leasekeeper.fence_table import ensure_schema_asyncpg

# The trigger copies rows of namespaces starting with "history-" only, so other
# tests sharing the database pay nothing.
SCHEMA_SQL = """
SELECT pg_advisory_xact_lock(727274);
CREATE TABLE IF NOT EXISTS history_task_versions (
    version_id      bigserial PRIMARY KEY,
    namespace       text NOT NULL,
    task_id         text NOT NULL,
    owner_id        text NOT NULL,
    fence           bigint NOT NULL,
    state           text NOT NULL,
    expire_time     timestamptz,
    claim_time      timestamptz,
    update_time     timestamptz,
    end_reason      text,
    recorded_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- Added after the first version of this table (a database kept between runs has it).
ALTER TABLE history_task_versions
    ADD COLUMN IF NOT EXISTS attempts integer,
    ADD COLUMN IF NOT EXISTS max_attempts integer,
    ADD COLUMN IF NOT EXISTS checkpoint_version bigint,
    ADD COLUMN IF NOT EXISTS checkpoint_fence bigint,
    ADD COLUMN IF NOT EXISTS checkpoint_time timestamptz,
    ADD COLUMN IF NOT EXISTS checkpoint_data bytea;
CREATE INDEX IF NOT EXISTS history_task_versions_task
    ON history_task_versions (namespace, task_id, version_id);
CREATE OR REPLACE FUNCTION history_record_task_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.namespace LIKE 'history-%' THEN
        INSERT INTO history_task_versions
            (namespace, task_id, owner_id, fence, state, expire_time, claim_time,
             update_time, end_reason, attempts, max_attempts, checkpoint_version,
             checkpoint_fence, checkpoint_time, checkpoint_data)
        VALUES (NEW.namespace, NEW.task_id, NEW.owner_id, NEW.fence, NEW.state,
                NEW.expire_time, NEW.claim_time, NEW.update_time, NEW.end_reason,
                NEW.attempts, NEW.max_attempts, NEW.checkpoint_version,
                NEW.checkpoint_fence, NEW.checkpoint_time, NEW.checkpoint_data);
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS history_record_task_version ON leasekeeper_tasks;
CREATE TRIGGER history_record_task_version
    AFTER INSERT OR UPDATE ON leasekeeper_tasks
    FOR EACH ROW EXECUTE FUNCTION history_record_task_version();
CREATE TABLE IF NOT EXISTS history_applies (
    apply_id        bigserial PRIMARY KEY,
    namespace       text NOT NULL,
    task_id         text NOT NULL,
    effect_key      text NOT NULL,
    policy          text NOT NULL,
    fence           bigint NOT NULL,
    owner_id        text NOT NULL,
    apply_time      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS history_applies_effect
    ON history_applies (namespace, task_id, effect_key);
"""

INSERT_APPLY_SQL = """
INSERT INTO history_applies (namespace, task_id, effect_key, policy, fence, owner_id)
VALUES ($1, $2, $3, $4, $5, $6)
RETURNING apply_id, apply_time
"""

# The newest apply of an effect, for reconciling an attempt left in doubt.
FIND_APPLY_SQL = """
SELECT apply_id FROM history_applies
WHERE namespace = $1 AND task_id = $2 AND effect_key = $3
ORDER BY apply_id DESC LIMIT 1
"""


async def ensure_schema(conn: asyncpg.Connection) -> None:
    """Creates the history tables, the trigger and the fence table (idempotent)."""
    async with conn.transaction():
        await conn.execute(SCHEMA_SQL)
    await ensure_schema_asyncpg(conn)

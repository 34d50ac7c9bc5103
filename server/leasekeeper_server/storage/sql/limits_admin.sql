-- Operators' statements on leasekeeper_namespace_limits (`leasekeeper limits`),
-- used by cli/limits.py. The claim bucket's columns (bucket_tokens,
-- bucket_time) belong to the claims that take tokens; these statements only
-- reset them (to NULL: a full bucket) when the rate or the burst changes.
-- Every change is announced on channel leasekeeper_config by the table's
-- trigger, so servers reload at once.

-- name: set_limits
-- Upserts namespace $1's limits; a NULL argument keeps the current value
-- (or the column's default for a new row). $6: the default max_attempts.
-- An existing row whose limits already have these values is left alone (no
-- row returned, no announcement): the caller reads it with get_limits.
INSERT INTO leasekeeper_namespace_limits AS l
    (namespace, max_leases, claims_per_second, claim_burst, lock_delay, max_attempts)
VALUES ($1::text, $2::integer, $3::double precision, $4::double precision,
        coalesce($5::interval, interval '0'), $6::integer)
ON CONFLICT (namespace) DO UPDATE SET
    max_leases = coalesce($2::integer, l.max_leases),
    claims_per_second = coalesce($3::double precision, l.claims_per_second),
    claim_burst = coalesce($4::double precision, l.claim_burst),
    lock_delay = coalesce($5::interval, l.lock_delay),
    max_attempts = coalesce($6::integer, l.max_attempts),
    bucket_tokens = CASE
        WHEN (coalesce($3::double precision, l.claims_per_second),
              coalesce($4::double precision, l.claim_burst))
             IS DISTINCT FROM (l.claims_per_second, l.claim_burst) THEN NULL
        ELSE l.bucket_tokens END,
    bucket_time = CASE
        WHEN (coalesce($3::double precision, l.claims_per_second),
              coalesce($4::double precision, l.claim_burst))
             IS DISTINCT FROM (l.claims_per_second, l.claim_burst) THEN NULL
        ELSE l.bucket_time END,
    update_time = clock_timestamp()
WHERE (coalesce($2::integer, l.max_leases), coalesce($3::double precision, l.claims_per_second),
       coalesce($4::double precision, l.claim_burst), coalesce($5::interval, l.lock_delay),
       coalesce($6::integer, l.max_attempts))
      IS DISTINCT FROM (l.max_leases, l.claims_per_second, l.claim_burst, l.lock_delay,
                        l.max_attempts)
RETURNING namespace, max_leases, claims_per_second, claim_burst, lock_delay, max_attempts,
          update_time;

-- name: get_limits
-- Namespace $1's limits, its row locked until the transaction ends; no row
-- when it has none.
SELECT namespace, max_leases, claims_per_second, claim_burst, lock_delay, max_attempts,
       update_time
FROM leasekeeper_namespace_limits
WHERE namespace = $1::text
FOR UPDATE;

-- name: clear_limits
-- Clears the named limits of namespace $1: $2 max_leases, $3 the rate (and
-- its burst), $4 the burst alone, $5 the lock delay (back to 0), $6 the
-- default max_attempts. A row where none of them is set is left alone (no
-- row returned, no announcement).
UPDATE leasekeeper_namespace_limits AS l SET
    max_leases = CASE WHEN $2::boolean THEN NULL ELSE l.max_leases END,
    claims_per_second = CASE WHEN $3::boolean THEN NULL ELSE l.claims_per_second END,
    claim_burst = CASE WHEN $3::boolean OR $4::boolean THEN NULL ELSE l.claim_burst END,
    lock_delay = CASE WHEN $5::boolean THEN interval '0' ELSE l.lock_delay END,
    max_attempts = CASE WHEN $6::boolean THEN NULL ELSE l.max_attempts END,
    bucket_tokens = CASE WHEN $3::boolean OR $4::boolean THEN NULL ELSE l.bucket_tokens END,
    bucket_time = CASE WHEN $3::boolean OR $4::boolean THEN NULL ELSE l.bucket_time END,
    update_time = clock_timestamp()
WHERE namespace = $1::text
  AND (($2::boolean AND l.max_leases IS NOT NULL)
       OR ($3::boolean AND (l.claims_per_second IS NOT NULL OR l.claim_burst IS NOT NULL))
       OR ($4::boolean AND l.claim_burst IS NOT NULL)
       OR ($5::boolean AND l.lock_delay <> interval '0')
       OR ($6::boolean AND l.max_attempts IS NOT NULL))
RETURNING namespace, max_leases, claims_per_second, claim_burst, lock_delay, max_attempts,
          update_time;

-- name: delete_limits
-- Removes namespace $1's row: no limits, no lock delay, no default max_attempts.
DELETE FROM leasekeeper_namespace_limits WHERE namespace = $1::text
RETURNING namespace;

-- name: delete_empty_limits
-- Removes namespace $1's row when it no longer limits anything.
DELETE FROM leasekeeper_namespace_limits
WHERE namespace = $1::text AND max_leases IS NULL AND claims_per_second IS NULL
  AND claim_burst IS NULL AND lock_delay = interval '0' AND max_attempts IS NULL
RETURNING namespace;

-- name: list_limits
-- Every namespace's limits, by namespace.
SELECT namespace, max_leases, claims_per_second, claim_burst, lock_delay, max_attempts,
       update_time
FROM leasekeeper_namespace_limits
ORDER BY namespace;

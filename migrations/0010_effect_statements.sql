-- BeginEffect and CompleteEffect are one statement each (statements
-- begin_effect, complete_effect and complete_effect_saving in
-- server/leasekeeper_server/storage/sql/queries.sql), no longer a transaction
-- of several. A statement cannot roll itself back by answering: to undo what
-- it wrote, it must fail. This function is how begin_effect fails.
--
-- begin_effect decides on the database clock read after it holds the task's
-- row and the effect's record, then writes the reservation. Writing a key's
-- first reservation can still wait: for another transaction inserting the
-- same key at that moment, which may roll back (PostgreSQL's INSERT ... ON
-- CONFLICT waits for it, and on a rollback inserts the row decided before the
-- wait). The lease may run out during that wait, so after the write the
-- statement reads the clock once more, and when the lease is no longer live
-- it calls this function: the error aborts the statement, and PostgreSQL
-- undoes the reservation. storage/ledger.py answers the caller LeaseLost.
--
-- SQLSTATE LK001 (class LK is no PostgreSQL class) names this refusal and
-- nothing else; the message names the fence.
CREATE FUNCTION leasekeeper_lease_ran_out(fence bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RAISE EXCEPTION 'the lease of fence % ran out before the effect was written', fence
        USING ERRCODE = 'LK001';
END;
$$;

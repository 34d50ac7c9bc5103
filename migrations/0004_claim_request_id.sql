-- The request id of the claim that granted each task's current fence
-- (ClaimRequest.request_id, AIP-155), so that a retry of that claim can be
-- told from a new incarnation of the same owner.
--
-- A claim by the owner of a live lease:
--   with this request_id         -> a retry: the same lease back, no new fence
--   with another request_id      -> a new incarnation (a restarted process that
--                                   reuses its owner id): granted with the next
--                                   fence, the earlier fence superseded
--   with no request_id           -> the same lease back (clients older than the
--                                   field; they cannot tell a retry from a restart)
-- NULL when the grant carried no request id, and for every row granted before
-- this migration. Opaque and compared byte for byte, like the other ids.
ALTER TABLE leasekeeper_tasks
    ADD COLUMN claim_request_id text COLLATE "C";

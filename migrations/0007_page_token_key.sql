-- The key that signs ListLeases and ListEffects page tokens (paging.py).
--
-- A page token names where the next page starts and is bound, by an HMAC
-- with this key, to the listing that issued it (its RPC, namespace, filters),
-- so a forged, tampered or borrowed token is refused instead of silently
-- skipping tasks. Every replica must verify every other's tokens, before and
-- after restarts, with no setting to share: the key lives here, generated
-- once by the database (gen_random_uuid(), from PostgreSQL's strong random
-- source, core since PostgreSQL 13: two give 244 random bits), and each
-- server reads it once at start. Replacing it (UPDATE ... SET key = ...)
-- invalidates the tokens of listings in progress once the servers restart;
-- their callers get INVALID_ARGUMENT and list again from the first page.
-- One row, always.
CREATE TABLE leasekeeper_page_token_key (
    one_row     boolean PRIMARY KEY DEFAULT true CHECK (one_row),
    key         bytea NOT NULL CHECK (octet_length(key) >= 32),
    create_time timestamptz NOT NULL DEFAULT clock_timestamp()
);

INSERT INTO leasekeeper_page_token_key (key)
SELECT uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid());

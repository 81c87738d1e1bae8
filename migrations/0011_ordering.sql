-- 0011_ordering: ordered delivery per key (docs/ordering.md).
--
-- - ordering_key: a row may carry a key (1 to 256 characters). Within a key, rows are
--   delivered in the order their producers' transactions committed.
-- - ordering_seq: the row's place in its key, given by the trigger below from
--   relayd_key_seqs: the key's row there is locked by the inserting transaction until it
--   ends, so a second writer of the key waits for the first to commit (or roll back) and
--   takes the next number. Numbers therefore follow commit order. A number may be skipped
--   (a rolled-back insert, an append that found its event id already stored): only the
--   order counts.
-- - A keyed row is written with available_at 'infinity': the unordered claim's index range
--   never reaches it, and the ordered claim (relayd/store/sql/cycle.sql) finds the key's head
--   (its pending row with the lowest number) through the index below. From its first claim
--   on, a head's available_at holds its lease and its backoff as any row's does.
-- - relayd_key_seqs is written by producers only, relayd_parked_keys by relays and operators
--   only: a relay's settle never waits behind a producer's open transaction.
-- - relayd_parked_keys: a key whose head exhausted its attempts or was refused for good. Its
--   rows wait until an operator retries, skips or releases the key (`relayd keys`). The
--   destination column leaves room for one event sent to several destinations: order and
--   parking are per (key, destination).
--
-- The trigger fires only for keyed rows (WHEN): an unkeyed append costs what it did.

ALTER TABLE @outbox@
    ADD COLUMN IF NOT EXISTS ordering_key text COLLATE "C",
    ADD COLUMN IF NOT EXISTS ordering_seq bigint;

ALTER TABLE @outbox@
    DROP CONSTRAINT IF EXISTS relayd_ordering_key_length,
    ADD CONSTRAINT relayd_ordering_key_length
        CHECK (ordering_key IS NULL OR length(ordering_key) BETWEEN 1 AND 256) NOT VALID;

CREATE TABLE IF NOT EXISTS @schema@.relayd_key_seqs (
    outbox_table text   NOT NULL,
    ordering_key text   COLLATE "C" NOT NULL,
    last_seq     bigint NOT NULL,
    PRIMARY KEY (outbox_table, ordering_key)
);

CREATE TABLE IF NOT EXISTS @schema@.relayd_parked_keys (
    outbox_table text        NOT NULL,
    destination  text        NOT NULL DEFAULT '',
    ordering_key text        COLLATE "C" NOT NULL,
    event_id     uuid        NOT NULL,  -- the head that parked it
    type         text        NOT NULL,  -- the head's event type (its route)
    reason       text        NOT NULL,  -- a dead reason: max_attempts, sink_rejected, ...
    error        text,
    parked_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (outbox_table, destination, ordering_key)
);

CREATE OR REPLACE FUNCTION @schema@.relayd_sequence_key() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO @schema@.relayd_key_seqs AS s (outbox_table, ordering_key, last_seq)
    VALUES (TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, NEW.ordering_key, 1)
    ON CONFLICT (outbox_table, ordering_key) DO UPDATE SET last_seq = s.last_seq + 1
    RETURNING last_seq INTO NEW.ordering_seq;
    NEW.available_at := 'infinity';
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS relayd_sequence_key ON @outbox@;
CREATE TRIGGER relayd_sequence_key
    BEFORE INSERT ON @outbox@
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL)
    EXECUTE FUNCTION @schema@.relayd_sequence_key();

-- An outbox whose rows carry their key in a column of their own (a Debezium-shaped table's
-- aggregateid): `relayd migrate` with outbox.ordering_key_column set gives the table a
-- trigger calling this function with the column's name, which copies the column into
-- ordering_key before the row is numbered (PostgreSQL fires a table's BEFORE triggers in the
-- order of their names: relayd_key_from_column, then relayd_sequence_key). A row that names
-- its ordering_key itself keeps it.
CREATE OR REPLACE FUNCTION @schema@.relayd_key_from_column() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    NEW.ordering_key := nullif(to_jsonb(NEW) ->> TG_ARGV[0], '');
    RETURN NEW;
END
$$;

-- The ordered claim's walk: per key, its pending rows in order; the first is the head.
CREATE INDEX IF NOT EXISTS "@name@_relayd_key_heads"
    ON @outbox@ (ordering_key, ordering_seq)
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL;

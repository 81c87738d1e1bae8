-- The outbox's schema and the migrations ledger (relayd/store/schema.py).
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

-- name: outbox_columns
-- The relay columns present on the outbox table, to tell "not migrated" from ready. Read from
-- the catalogs, which every role may read: information_schema lists only the columns the
-- role holds a privilege on, and a missing grant would look like a missing table.
-- params: $1 schema text, $2 table text
SELECT a.attname::text AS column_name
FROM pg_attribute AS a
JOIN pg_class AS c ON c.oid = a.attrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped;

-- name: migrations_lock
-- Serialise concurrent `relayd migrate` runs on one outbox until the transaction ends.
-- params: $1 outbox table text
SELECT pg_advisory_xact_lock(hashtext('relayd.migrate'), hashtext($1));

-- name: migrations_schema_create
-- The outbox's schema, created under the migration lock before the ledger that lives in it.
-- params: none
CREATE SCHEMA IF NOT EXISTS @schema@;

-- name: migrations_ledger_create
-- The ledger of applied migrations, one row per (outbox table, version).
-- params: none
CREATE TABLE IF NOT EXISTS @schema@.relayd_migrations (
    outbox_table text        NOT NULL,
    version      integer     NOT NULL,
    name         text        NOT NULL,
    checksum     text        NOT NULL,
    applied_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (outbox_table, version)
);

-- name: migrations_applied
-- The migrations already applied to this outbox.
-- params: $1 outbox table text
SELECT version, name, checksum, applied_at
FROM @schema@.relayd_migrations
WHERE outbox_table = $1
ORDER BY version;

-- name: migrations_record
-- Record one applied migration.
-- params: $1 outbox table text, $2 version int, $3 name text, $4 checksum text
INSERT INTO @schema@.relayd_migrations (outbox_table, version, name, checksum)
VALUES ($1, $2, $3, $4);

-- name: notify_trigger_state
-- The outbox's NOTIFY trigger (migration 0001): NULL when it has none, else its
-- pg_trigger.tgenabled ('D': disabled by hand, it never fires).
-- params: $1 outbox table text
SELECT (SELECT tgenabled::text
        FROM pg_trigger
        WHERE tgrelid = to_regclass($1)::oid AND tgname = 'relayd_notify_insert');

-- name: notify_trigger_create
-- One NOTIFY per inserting statement, on the channel 'schema.table' (outbox.notify_trigger
-- = true): created by 0001, again by `relayd migrate` if it was dropped.
-- params: none
CREATE TRIGGER relayd_notify_insert
    AFTER INSERT ON @outbox@
    FOR EACH STATEMENT
    EXECUTE FUNCTION @schema@.relayd_notify_outbox();

-- name: notify_trigger_drop
-- No NOTIFY from producers' inserts (outbox.notify_trigger = false): PostgreSQL refuses
-- PREPARE TRANSACTION in a transaction that notified, so two-phase-commit producers need it
-- gone. Relays then poll.
-- params: none
DROP TRIGGER IF EXISTS relayd_notify_insert ON @outbox@;

-- name: key_column_trigger_state
-- The column the outbox's key-from-column trigger copies into ordering_key (its argument), or
-- NULL when it has none (outbox.ordering_key_column unset).
-- params: $1 outbox table text
SELECT (SELECT split_part(encode(tgargs, 'escape'), '\000', 1)
        FROM pg_trigger
        WHERE tgrelid = to_regclass($1)::oid AND tgname = 'relayd_key_from_column');

-- name: key_column_exists
-- Whether the outbox has the column outbox.ordering_key_column names.
-- params: $1 outbox table text, $2 column text
SELECT EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = to_regclass($1)::oid AND attname = $2 AND attnum > 0
                 AND NOT attisdropped);

-- name: key_column_trigger_drop
-- No key copied from a column of the row's own.
-- params: none
DROP TRIGGER IF EXISTS relayd_key_from_column ON @outbox@;

-- name: key_column_trigger_create
-- Copy the column outbox.ordering_key_column names into ordering_key on every insert that
-- sets none (migration 0011's relayd_key_from_column). `%column%` is replaced by the column's
-- name, checked to be a plain identifier, as the trigger's one argument.
-- params: none
CREATE TRIGGER relayd_key_from_column
    BEFORE INSERT ON @outbox@
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NULL)
    EXECUTE FUNCTION @schema@.relayd_key_from_column('%column%');

-- 0006_due_once_writing: a new row's available_at is stamped only once its transaction shows
-- in pg_stat_activity as a writer (relayd/watermark.py, docs/performance.md).
--
-- A transaction gets its id, and shows as a writer, at its first write. A column default is
-- evaluated when the row is formed, before BEFORE INSERT triggers, CHECK constraints and the
-- write itself: with clock_timestamp() as the default, an INSERT that spent seconds between
-- the two (a slow trigger, a CHECK calling a function, a slow default on another column)
-- stamped its row while its transaction was invisible to the claims of that time, which
-- moved their watermark past the row; it then waited for the next full scan.
--
-- relayd_available_at() takes the transaction's id first (txid_current() assigns one if the
-- transaction has none; PostgreSQL 11 and later have it), then reads the clock: whatever the
-- INSERT does before or after, every claim that reads pg_stat_activity from that moment sees
-- the transaction's start, which is earlier than the stamp. relayd's own statements that make
-- a row due at once (release, a retry with a tiny backoff) use it too.
--
-- Plain SQL with the call in a CASE condition: the planner inlines the body into the INSERT
-- (no function call per row: it costs what clock_timestamp() alone does), cannot fold the
-- condition away (txid_current() is not immutable), and a CASE evaluates its condition before
-- its branches. txid_current() never returns NULL.
-- Existing rows keep their values; only the default changes (no rewrite, no long lock).

CREATE OR REPLACE FUNCTION @schema@.relayd_available_at() RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL UNSAFE
AS $$ SELECT CASE WHEN txid_current() IS NULL THEN NULL ELSE clock_timestamp() END $$;

ALTER TABLE @outbox@ ALTER COLUMN available_at SET DEFAULT @schema@.relayd_available_at();

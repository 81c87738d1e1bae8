-- 0008_row_checks: the outbox's eight CHECK constraints become one, which calls a PL/pgSQL
-- function holding the same eight rules.
--
-- Why: PostgreSQL prepares a table's CHECK expressions once per statement (and plans them
-- then), not once per session. For a single-row INSERT, what a producer's append is, the
-- eight expressions cost more server CPU than the rest of the insert: on PostgreSQL 15, about
-- 130 µs per single-row INSERT with them against 50 µs without (docs/performance.md). A
-- PL/pgSQL function caches its expressions' plans for the whole session, so the one
-- constraint that calls it adds about 20 µs to a single-row INSERT (70 µs in all); UPDATEs of
-- many rows (the claim, the settles) cost the same as before.
--
-- The rules, their names and their outcome are the same: a row is refused when one rule is
-- false (a rule that is NULL passes, as a CHECK does), with SQLSTATE 23514 (check_violation)
-- and the refused rule's old name as the error's constraint name and in its message, so
-- applications, `relayd dlq retry` and people read the same error as before. The rules are
-- tried in the order PostgreSQL tried the constraints (by name).
--
-- NOT VALID: every existing row passed these same rules under the constraints this replaces,
-- moments earlier in this transaction, so there is nothing to re-check; validating would scan
-- the whole table while the migration holds its lock. New and updated rows are checked.
--
-- The function is shared by the outboxes of the schema (like relayd_notify_outbox); it reads
-- nothing but its arguments, and every role that writes the outbox needs EXECUTE on it
-- (PUBLIC holds it unless revoked; `relayd grants` lists it).

CREATE OR REPLACE FUNCTION @schema@.relayd_check_row(
    event_id uuid,
    job jsonb,
    attempts integer,
    created_at timestamptz,
    published_at timestamptz,
    dead_at timestamptz
) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    refused text;
BEGIN
    -- One expression for the common case: an AND is false only when one of its parts is.
    IF (attempts >= 0
        AND (published_at IS NOT NULL OR dead_at IS NOT NULL OR isfinite(created_at))
        AND (published_at IS NOT NULL OR dead_at IS NOT NULL
             OR (substr(event_id::text, 15, 1) = '7'
                 AND substr(event_id::text, 20, 1) IN ('8', '9', 'a', 'b')))
        AND (dead_at IS NOT NULL OR jsonb_typeof(job -> 'args') = 'array')
        AND job ->> 'id' = event_id::text
        AND (dead_at IS NOT NULL OR jsonb_typeof(job) = 'object')
        AND (dead_at IS NOT NULL OR coalesce(jsonb_typeof(job -> 'meta'), 'object') = 'object')
        AND (dead_at IS NOT NULL OR jsonb_typeof(job -> 'type') = 'string')) IS NOT FALSE THEN
        RETURN true;
    END IF;
    -- A refusal: the first rule, by name, that is false.
    IF (attempts >= 0) IS FALSE THEN
        refused := 'relayd_attempts_not_negative';
    ELSIF (published_at IS NOT NULL OR dead_at IS NOT NULL OR isfinite(created_at)) IS FALSE THEN
        refused := 'relayd_created_at_is_finite';
    ELSIF (published_at IS NOT NULL OR dead_at IS NOT NULL
           OR (substr(event_id::text, 15, 1) = '7'
               AND substr(event_id::text, 20, 1) IN ('8', '9', 'a', 'b'))) IS FALSE THEN
        refused := 'relayd_event_id_is_uuidv7';
    ELSIF (dead_at IS NOT NULL OR jsonb_typeof(job -> 'args') = 'array') IS FALSE THEN
        refused := 'relayd_job_args_is_array';
    ELSIF (job ->> 'id' = event_id::text) IS FALSE THEN
        refused := 'relayd_job_id_matches_event_id';
    ELSIF (dead_at IS NOT NULL OR jsonb_typeof(job) = 'object') IS FALSE THEN
        refused := 'relayd_job_is_object';
    ELSIF (dead_at IS NOT NULL
           OR coalesce(jsonb_typeof(job -> 'meta'), 'object') = 'object') IS FALSE THEN
        refused := 'relayd_job_meta_is_object';
    ELSE
        refused := 'relayd_job_type_is_string';
    END IF;
    RAISE EXCEPTION 'new row violates check constraint "%"', refused
        USING ERRCODE = 'check_violation', CONSTRAINT = refused;
END
$$;

ALTER TABLE @outbox@
    DROP CONSTRAINT IF EXISTS relayd_attempts_not_negative,
    DROP CONSTRAINT IF EXISTS relayd_created_at_is_finite,
    DROP CONSTRAINT IF EXISTS relayd_event_id_is_uuidv7,
    DROP CONSTRAINT IF EXISTS relayd_job_args_is_array,
    DROP CONSTRAINT IF EXISTS relayd_job_id_matches_event_id,
    DROP CONSTRAINT IF EXISTS relayd_job_is_object,
    DROP CONSTRAINT IF EXISTS relayd_job_meta_is_object,
    DROP CONSTRAINT IF EXISTS relayd_job_type_is_string,
    ADD CONSTRAINT relayd_row_checks
        CHECK (@schema@.relayd_check_row(event_id, job, attempts, created_at, published_at,
                                         dead_at)) NOT VALID;

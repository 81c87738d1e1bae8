-- 0001_outbox: the outbox table with its relay columns, checks, claim index and wakeup trigger.
--
-- Placeholders (substituted by relayd/migrate.py with validated, quoted identifiers):
--   @outbox@  the schema-qualified table      @schema@  its schema
--   @name@    the bare table name (only inside quoted derived index names)
--
-- It creates the table, or adopts one made with the minimal outbox DDL (event_id, job,
-- created_at, published_at and its own CHECK) by adding what is missing. Every existing row
-- is kept.

CREATE SCHEMA IF NOT EXISTS @schema@;

CREATE TABLE IF NOT EXISTS @outbox@ (
    event_id     uuid        PRIMARY KEY,
    job          jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);

-- now() is stable, so existing rows get one fast default (no table rewrite).
ALTER TABLE @outbox@
    ADD COLUMN IF NOT EXISTS attempts        integer     NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS available_at    timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS lease_owner     uuid,
    ADD COLUMN IF NOT EXISTS last_error      text,
    ADD COLUMN IF NOT EXISTS last_attempt_at timestamptz,
    ADD COLUMN IF NOT EXISTS dead_at         timestamptz,
    ADD COLUMN IF NOT EXISTS dead_reason     text,
    ADD COLUMN IF NOT EXISTS sink_state      text;

-- An adopted table may hold unpublished rows the checks below would refuse. They could never
-- publish, so they are dead-lettered (kept, visible to operators) instead of failing the
-- migration or being rewritten.
UPDATE @outbox@
SET dead_at = now(),
    dead_reason = 'invalid_envelope',
    last_error = 'dead-lettered by relayd migrate: the envelope fails the outbox checks'
WHERE published_at IS NULL
  AND dead_at IS NULL
  AND NOT coalesce(
        jsonb_typeof(job) = 'object'
        AND jsonb_typeof(job -> 'args') = 'array'
        AND jsonb_typeof(job -> 'type') = 'string'
        AND coalesce(jsonb_typeof(job -> 'meta'), 'object') = 'object',
        false);

-- Named checks: a producer's bad insert fails in its own transaction, naming the rule. The
-- shape checks exempt dead rows, so the rows dead-lettered above stay valid.
ALTER TABLE @outbox@
    ADD CONSTRAINT relayd_job_id_matches_event_id
        CHECK (job ->> 'id' = event_id::text),
    ADD CONSTRAINT relayd_job_is_object
        CHECK (dead_at IS NOT NULL OR jsonb_typeof(job) = 'object'),
    ADD CONSTRAINT relayd_job_args_is_array
        CHECK (dead_at IS NOT NULL OR jsonb_typeof(job -> 'args') = 'array'),
    ADD CONSTRAINT relayd_job_type_is_string
        CHECK (dead_at IS NOT NULL OR jsonb_typeof(job -> 'type') = 'string'),
    ADD CONSTRAINT relayd_job_meta_is_object
        CHECK (dead_at IS NOT NULL OR coalesce(jsonb_typeof(job -> 'meta'), 'object') = 'object'),
    ADD CONSTRAINT relayd_attempts_not_negative
        CHECK (attempts >= 0);

-- The claim reads this index in order and stops after LIMIT rows, whatever the backlog.
CREATE INDEX IF NOT EXISTS "@name@_relayd_claim"
    ON @outbox@ (available_at, event_id)
    WHERE published_at IS NULL AND dead_at IS NULL;

-- Retention cleanup finds old published rows without scanning the table.
CREATE INDEX IF NOT EXISTS "@name@_relayd_published"
    ON @outbox@ (published_at)
    WHERE published_at IS NOT NULL;

-- One notification per inserting statement (and PostgreSQL folds duplicates per
-- transaction); the channel is 'schema.table', so one function serves every outbox.
CREATE OR REPLACE FUNCTION @schema@.relayd_notify_outbox() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    RETURN NULL;
END
$$;

CREATE TRIGGER relayd_notify_insert
    AFTER INSERT ON @outbox@
    FOR EACH STATEMENT
    EXECUTE FUNCTION @schema@.relayd_notify_outbox();

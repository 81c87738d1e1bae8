-- 0003_operator: what operators need.
--
-- - relayd_instances: every running relay's heartbeat (who is running, since when, doing what);
-- - relayd_pauses: pauses every relay obeys, for one queue or all ('*');
-- - relayd_audit: one row per mutating operator action (redrive, discard, pause, resume);
-- - discarded dead letters (kept, marked, out of the dead-letter queue);
-- - the indexes that keep the backlog sampler and the dead-letter commands cheap on a large
--   outbox: the oldest pending row, and dead letters awaiting an operator;
-- - relayd_uuidv7(), to make the ids below in SQL on PostgreSQL before 18;
-- - an event_id that is not a UUIDv7 is refused at INSERT: OJS servers accept only version 7
--   ids, so such a row could only ever be dead-lettered by the sink. On an adopted table the
--   pending ones are dead-lettered here first, as 0001 does with envelopes that fail its checks.
--
-- The three tables live in the outbox's schema and serve every outbox in it (keyed by
-- outbox_table), like the migration ledger.

ALTER TABLE @outbox@
    ADD COLUMN IF NOT EXISTS discarded_at   timestamptz,
    ADD COLUMN IF NOT EXISTS discard_reason text;

-- The queue a job is routed to: options.queue (OJS binding), else a top-level queue (the
-- gateway variant), else 'default'. Inlined by the planner (SQL, immutable).
CREATE OR REPLACE FUNCTION @schema@.relayd_effective_queue(job jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT coalesce(job #>> '{options,queue}', job ->> 'queue', 'default') $$;

-- A UUIDv7 (RFC 9562) from SQL, for producers that write the outbox with plain SQL on a
-- PostgreSQL without a built-in uuidv7(): 48 bits of Unix milliseconds over a random v4,
-- with the version bits set to 7 (the v4 variant bits are already right).
CREATE OR REPLACE FUNCTION @schema@.relayd_uuidv7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

UPDATE @outbox@
SET dead_at = now(),
    dead_reason = 'invalid_envelope',
    last_error = 'dead-lettered by relayd migrate: event_id is not a UUIDv7 '
                 '(OJS servers accept only version 7 ids)',
    lease_owner = NULL
WHERE published_at IS NULL
  AND dead_at IS NULL
  AND NOT (substr(event_id::text, 15, 1) = '7' AND substr(event_id::text, 20, 1) IN ('8', '9', 'a', 'b'));

ALTER TABLE @outbox@
    ADD CONSTRAINT relayd_event_id_is_uuidv7
        CHECK (published_at IS NOT NULL
               OR dead_at IS NOT NULL
               OR (substr(event_id::text, 15, 1) = '7'
                   AND substr(event_id::text, 20, 1) IN ('8', '9', 'a', 'b')));

-- The oldest unpublished, not dead row (relayd_outbox_oldest_pending_age_seconds).
CREATE INDEX IF NOT EXISTS "@name@_relayd_pending_created"
    ON @outbox@ (created_at)
    WHERE published_at IS NULL AND dead_at IS NULL;

-- Dead letters awaiting an operator, oldest first (counts, `relayd dlq list`).
CREATE INDEX IF NOT EXISTS "@name@_relayd_dead"
    ON @outbox@ (dead_at, event_id)
    WHERE dead_at IS NOT NULL AND discarded_at IS NULL;

CREATE TABLE IF NOT EXISTS @schema@.relayd_instances (
    outbox_table  text        NOT NULL,
    instance_id   uuid        NOT NULL,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    version       text        NOT NULL,
    started_at    timestamptz NOT NULL,
    last_seen     timestamptz NOT NULL,
    breaker_state text        NOT NULL,
    in_flight     integer     NOT NULL,
    PRIMARY KEY (outbox_table, instance_id)
);

CREATE TABLE IF NOT EXISTS @schema@.relayd_pauses (
    outbox_table text        NOT NULL,
    queue        text        NOT NULL,  -- '*': every queue
    reason       text        NOT NULL,
    paused_by    text        NOT NULL,
    paused_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (outbox_table, queue)
);

CREATE TABLE IF NOT EXISTS @schema@.relayd_audit (
    id           bigserial   PRIMARY KEY,
    at           timestamptz NOT NULL DEFAULT now(),
    outbox_table text        NOT NULL,
    actor        text        NOT NULL,
    action       text        NOT NULL,  -- dlq.retry, dlq.discard, pause, resume
    filters      jsonb       NOT NULL DEFAULT '{}',
    event_ids    uuid[],                -- the rows acted on, when listed
    row_count    integer     NOT NULL,
    reason       text
);

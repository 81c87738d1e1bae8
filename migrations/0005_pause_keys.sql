-- 0005_pause_keys: pauses of one job type, and what a relay's housekeeping reports.
--
-- - relayd_pauses.type: a pause holds a queue ('*': every queue) and a job type ('*': every
--   type). The poison-storm guard pauses only the queue and type the sink rejects, so the
--   other types of that queue, and the other queues, keep flowing; an operator may pause one
--   type too (`relayd pause --queue Q --type T`). Existing pauses hold every type.
-- - relayd_held(): whether a job is held by the pauses of an outbox, given those pauses as
--   three arrays read once per statement (see the claim in relayd/sql/queries.sql).
-- - relayd_instances.housekeeping: the chores of a running relay (retention cleanup, the
--   backlog sampler, the heartbeat, storing a storm pause) that are failing, with their
--   errors, so that `relayd status` shows them on every host.
--
-- relayd_pauses and relayd_instances serve every outbox of the schema: each step is written
-- to run again, harmlessly, when a second outbox of the same schema is migrated.

ALTER TABLE @schema@.relayd_pauses
    ADD COLUMN IF NOT EXISTS type text NOT NULL DEFAULT '*';

ALTER TABLE @schema@.relayd_pauses
    DROP CONSTRAINT IF EXISTS relayd_pauses_pkey,
    ADD CONSTRAINT relayd_pauses_pkey PRIMARY KEY (outbox_table, queue, type);

-- A job is held when its effective queue is paused for every type (`queues`), its type is
-- paused in every queue (`types`), or its queue and type are paused together (`pairs`, as
-- 'queue type': neither a queue name nor a job type may hold a space). A pause of every
-- queue and every type is checked apart, before any row is read. Inlined by the planner (SQL,
-- immutable); a type that is absent or not a string counts as '' (such a row is refused by
-- the relay's own checks, never held by a type).
CREATE OR REPLACE FUNCTION @schema@.relayd_held(job jsonb, queues text[], types text[],
                                               pairs text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT @schema@.relayd_effective_queue(job) = ANY (queues)
        OR coalesce(job ->> 'type', '') = ANY (types)
        OR @schema@.relayd_effective_queue(job) || ' ' || coalesce(job ->> 'type', '')
           = ANY (pairs)
$$;

ALTER TABLE @schema@.relayd_instances
    ADD COLUMN IF NOT EXISTS housekeeping jsonb NOT NULL DEFAULT '{}';

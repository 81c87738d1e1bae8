-- Pauses and the rows they hold: `relayd pause`, `relayd resume`, `relayd held`, the
-- poison-storm guard's and the sink's pauses (relayd/store/pauses.py).
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

-- name: pause_upsert
-- Pause a queue ('*': every queue) and a job type ('*': every type) for every relay of this
-- outbox: the claim skips its rows from its next statement. Pausing again keeps paused_at
-- and takes the new reason and actor.
-- params: $1 outbox table text, $2 queue text, $3 type text, $4 reason text, $5 actor text
INSERT INTO @schema@.relayd_pauses (outbox_table, queue, type, reason, paused_by)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (outbox_table, queue, type) DO UPDATE
SET reason = excluded.reason,
    paused_by = excluded.paused_by
RETURNING (xmax = 0) AS inserted;  -- xmax is 0 on a freshly inserted row version

-- name: pause_insert
-- Pause a queue and a job type unless they are paused already (relayd's own pauses: the
-- sink's and the poison-storm guard's): an existing pause keeps its reason, its actor and
-- its audit trail. Returns true if it paused them, nothing if they were paused.
-- params: $1 outbox table text, $2 queue text, $3 type text, $4 reason text, $5 actor text
INSERT INTO @schema@.relayd_pauses (outbox_table, queue, type, reason, paused_by)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (outbox_table, queue, type) DO NOTHING
RETURNING true AS inserted;

-- name: pause_delete
-- Lift one pause; returns it, or nothing if that queue and type were not paused.
-- params: $1 outbox table text, $2 queue text, $3 type text
DELETE FROM @schema@.relayd_pauses
WHERE outbox_table = $1 AND queue = $2 AND type = $3
RETURNING queue, type, reason, paused_by, paused_at;

-- name: pauses_list
-- Every pause of this outbox, oldest first.
-- params: $1 outbox table text
SELECT queue, type, reason, paused_by, paused_at
FROM @schema@.relayd_pauses
WHERE outbox_table = $1
ORDER BY paused_at, queue, type;

-- name: held_list
-- `relayd held list`: pending rows a pause of this outbox holds, in claim order, matching
-- the filters. in_flight marks a row whose attempt started before its pause (the lease runs:
-- it settles on its own). The pauses' three sets are read once, as in backlog_sample.
-- params: $1 outbox table text, $2 queue text|null, $3 type text|null,
--         $4 error_contains text|null, $5 limit int
WITH pauses AS (
    SELECT count(*) > 0 AS any_paused,
           coalesce(bool_or(queue = '*' AND type = '*'), false) AS all_paused,
           coalesce(array_agg(queue) FILTER (WHERE type = '*'), '{}') AS queues,
           coalesce(array_agg(type) FILTER (WHERE queue = '*'), '{}') AS types,
           coalesce(array_agg(queue || ' ' || type)
                        FILTER (WHERE queue <> '*' AND type <> '*'), '{}') AS pairs
    FROM @schema@.relayd_pauses
    WHERE outbox_table = $1
)
SELECT o.event_id::text AS event_id, o.created_at, o.available_at,
       @schema@.relayd_effective_queue(o.job) AS queue, o.job ->> 'type' AS type, o.attempts,
       o.last_error, o.last_attempt_at,
       o.lease_owner IS NOT NULL AND o.available_at > now() AS in_flight
FROM @outbox@ AS o, pauses AS p
WHERE o.published_at IS NULL AND o.dead_at IS NULL
  AND p.any_paused
  AND (p.all_paused OR @schema@.relayd_held(o.job, p.queues, p.types, p.pairs))
  AND ($2::text IS NULL OR @schema@.relayd_effective_queue(o.job) = $2)
  AND ($3::text IS NULL OR o.job ->> 'type' = $3)
  AND ($4::text IS NULL OR strpos(lower(o.last_error), lower($4)) > 0)
ORDER BY o.available_at, o.event_id
LIMIT $5;

-- name: held_page
-- One batch of `relayd held discard --all`: the next $6 held rows after the keyset cursor
-- ($2, $3) in claim order that the filters select, locked until the batch's transaction
-- ends (rows another session holds are skipped: a claim taking them, if their pause was just
-- lifted). Each batch reads the claim index from its cursor on.
-- params: $1 outbox table text, $2 after available_at timestamptz, $3 after event_id uuid,
--         $4 queue text|null, $5 type text|null, $6 limit int, $7 error_contains text|null
WITH pauses AS (
    SELECT count(*) > 0 AS any_paused,
           coalesce(bool_or(queue = '*' AND type = '*'), false) AS all_paused,
           coalesce(array_agg(queue) FILTER (WHERE type = '*'), '{}') AS queues,
           coalesce(array_agg(type) FILTER (WHERE queue = '*'), '{}') AS types,
           coalesce(array_agg(queue || ' ' || type)
                        FILTER (WHERE queue <> '*' AND type <> '*'), '{}') AS pairs
    FROM @schema@.relayd_pauses
    WHERE outbox_table = $1
)
SELECT o.event_id::text AS event_id, o.available_at
FROM @outbox@ AS o, pauses AS p
WHERE o.published_at IS NULL AND o.dead_at IS NULL
  AND (o.available_at, o.event_id) > ($2::timestamptz, $3::uuid)
  AND p.any_paused
  AND (p.all_paused OR @schema@.relayd_held(o.job, p.queues, p.types, p.pairs))
  AND ($4::text IS NULL OR @schema@.relayd_effective_queue(o.job) = $4)
  AND ($5::text IS NULL OR o.job ->> 'type' = $5)
  AND ($7::text IS NULL OR strpos(lower(o.last_error), lower($7)) > 0)
ORDER BY o.available_at, o.event_id
LIMIT $6
FOR UPDATE OF o SKIP LOCKED;

-- name: held_discard
-- Discard held rows: an operator decided they will never be sent (a producer's bad release
-- that the poison-storm guard caught). Each is dead-lettered ('held_discarded') and marked
-- discarded at once, kept in the table (C7) and out of the dead-letter queue, with the
-- operator's reason; `relayd dlq retry ID` brings one back. Only rows still pending, held by
-- a pause and not in flight are changed; the lease is cleared so that a late settle of an
-- expired claim changes nothing (C3).
-- params: $1 event ids uuid[], $2 reason text, $3 outbox table text
WITH pauses AS (
    SELECT count(*) > 0 AS any_paused,
           coalesce(bool_or(queue = '*' AND type = '*'), false) AS all_paused,
           coalesce(array_agg(queue) FILTER (WHERE type = '*'), '{}') AS queues,
           coalesce(array_agg(type) FILTER (WHERE queue = '*'), '{}') AS types,
           coalesce(array_agg(queue || ' ' || type)
                        FILTER (WHERE queue <> '*' AND type <> '*'), '{}') AS pairs
    FROM @schema@.relayd_pauses
    WHERE outbox_table = $3
),
target AS (
    SELECT o.event_id,
           o.published_at IS NULL AND o.dead_at IS NULL AS pending,
           o.published_at IS NOT NULL AS published,
           p.any_paused
               AND (p.all_paused OR @schema@.relayd_held(o.job, p.queues, p.types, p.pairs))
               AS held,
           o.lease_owner IS NOT NULL AND o.available_at > now() AS in_flight
    FROM @outbox@ AS o, pauses AS p
    WHERE o.event_id = ANY($1::uuid[])
    FOR UPDATE OF o
),
discarded AS (
    UPDATE @outbox@ AS o
    SET dead_at = now(),
        dead_reason = 'held_discarded',
        lease_owner = NULL,
        discarded_at = now(),
        discard_reason = $2
    FROM target AS t
    WHERE o.event_id = t.event_id AND t.pending AND t.held AND NOT t.in_flight
    RETURNING o.event_id
)
SELECT t.event_id::text AS event_id, t.pending, t.published, t.held, t.in_flight,
       d.event_id IS NOT NULL AS changed
FROM target AS t
LEFT JOIN discarded AS d ON d.event_id = t.event_id;

-- name: queue_use
-- Whether a row of the outbox, in any state, routes to queue $1: `relayd pause --queue`
-- warns when none does (a typo, or a queue no producer has used yet). No index holds the
-- effective queue, so the read stops at the first such row or after $2 rows; `rows_read`,
-- counted only when no row routes there, says how far the queue was looked for.
-- params: $1 queue text, $2 most rows to read bigint
SELECT used,
       CASE WHEN used THEN NULL
            ELSE (SELECT count(*) FROM (SELECT FROM @outbox@ LIMIT $2) AS counted)
       END AS rows_read
FROM (SELECT EXISTS (SELECT FROM (SELECT job FROM @outbox@ LIMIT $2) AS bounded
                     WHERE @schema@.relayd_effective_queue(bounded.job) = $1) AS used) AS seen;

-- name: outbox_notify
-- Wake idle relays at once (on commit), on the channel the insert trigger uses.
-- params: $1 channel text
SELECT pg_notify($1, '');

-- name: audit_note
-- One operator action that changes no row (a pause, a resume), in its own transaction. No
-- RETURNING: the poison-storm guard pauses through it, and relayd's role needs no SELECT on
-- the audit trail.
-- params: $1 outbox table text, $2 actor text, $3 action text, $4 filters jsonb (as text),
--         $5 reason text|null
INSERT INTO @schema@.relayd_audit (outbox_table, actor, action, filters, row_count, reason)
VALUES ($1, $2, $3, $4::jsonb, 1, $5);

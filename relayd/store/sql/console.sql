-- What `relayd console` reads beyond the operator commands' statements (relayd/store/console.py):
-- a page of dead letters after a keyset cursor, one event whatever its state, and the audit
-- rows naming it. Every statement reads a bounded number of rows through an index.
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

-- name: console_dead_letters
-- A page of dead letters (not discarded) matching the filters, newest first, after the keyset
-- cursor ($3, $9): the dead-letter index (dead_at, event_id) read backwards from the cursor,
-- LIMIT $4, never an OFFSET or a count. A null cursor is the first page.
-- params: $1 since timestamptz|null, $2 until timestamptz|null, $3 before dead_at
--         timestamptz|null, $4 limit int, then the dead_letter_filters ($5-$8),
--         $9 before event_id uuid|null
SELECT event_id::text AS event_id, created_at, published_at, dead_at, dead_reason,
       @schema@.relayd_effective_queue(job) AS queue, job ->> 'type' AS type, attempts,
       last_error, last_attempt_at, discarded_at, discard_reason
FROM @outbox@ AS o
WHERE dead_at IS NOT NULL AND discarded_at IS NULL
  AND dead_at >= coalesce($1::timestamptz, '-infinity')
  AND dead_at < coalesce($2::timestamptz, 'infinity')
  AND ($3::timestamptz IS NULL OR (o.dead_at, o.event_id) < ($3::timestamptz, $9::uuid))
  AND @dead_letter_filters@
ORDER BY o.dead_at DESC, o.event_id DESC
LIMIT $4;

-- name: console_event
-- One outbox row, whatever its state, with what its timeline shows: its times, attempts,
-- last error, ordering key, whether its key is parked on it, and its envelope.
-- params: $1 event id uuid, $2 outbox table text
SELECT o.event_id::text AS event_id, o.created_at, o.available_at, o.published_at, o.dead_at,
       o.dead_reason, @schema@.relayd_effective_queue(o.job) AS queue, o.job ->> 'type' AS type,
       o.attempts, o.last_error, o.last_attempt_at, o.redriven_at, o.discarded_at,
       o.discard_reason, o.lease_owner IS NOT NULL AS leased, o.ordering_key, o.ordering_seq,
       EXISTS (SELECT 1 FROM @schema@.relayd_parked_keys AS p
               WHERE p.outbox_table = $2 AND p.ordering_key = o.ordering_key
                 AND p.event_id = o.event_id) AS parks_its_key,
       o.job::text AS job, now() AS now
FROM @outbox@ AS o
WHERE o.event_id = $1::uuid;

-- name: console_audit
-- The audit rows naming an event, among the latest $3 actions on this outbox (the primary
-- key read backwards): bounded, however long the trail. A bulk action past the ids it keeps
-- names no event, only its count.
-- params: $1 outbox table text, $2 event id uuid, $3 latest actions read int
SELECT recent.id, recent.at, recent.actor, recent.action, recent.filters::text AS filters,
       recent.row_count, recent.reason
FROM (SELECT id, at, actor, action, filters, row_count, reason, event_ids
      FROM @schema@.relayd_audit
      WHERE outbox_table = $1
      ORDER BY id DESC
      LIMIT $3) AS recent
WHERE recent.event_ids @> ARRAY[$2::uuid]
ORDER BY recent.id;

-- What `relayd console` reads beyond the operator commands' statements (relayd/store/console.py):
-- a page of dead letters after a keyset cursor, one event whatever its state, and the audit
-- rows naming it. Every statement reads a bounded number of rows through an index.
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

-- name: console_in_order
-- For the rest of the transaction, a plan that sorts is the planner's last resort: a page of
-- dead letters then walks the dead-letter index in order whatever the planner guesses of its
-- filters and cursor (guessing few rows, it would read and sort every dead letter; see
-- dlq_page). Only console_dlq runs after it.
-- params: none
SET LOCAL enable_sort = off;

-- name: console_dlq
-- A page of dead letters (not discarded) matching the filters, newest first, after the keyset
-- cursor ($3, $9; null: from the newest), and where the page's scan of the index ends. The
-- first part walks the dead-letter index (dead_at, event_id) backwards from the cursor
-- (console_in_order), reads at most $10 entries, and stops as soon as $4 of them match. The
-- second is the $10th entry from the cursor (`window_end`), read from the index alone: none
-- when the index ends before; a filter that matched fewer rows than a page goes on from
-- there. No count.
-- params: $1 since timestamptz|null, $2 until timestamptz|null, $3 before dead_at
--         timestamptz|null, $4 limit int, then the dead_letter_filters ($5-$8),
--         $9 before event_id uuid|null, $10 most entries read int
(SELECT o.event_id::text AS event_id, o.created_at, o.published_at, o.dead_at, o.dead_reason,
        @schema@.relayd_effective_queue(o.job) AS queue, o.job ->> 'type' AS type, o.attempts,
        o.last_error, o.last_attempt_at, o.discarded_at, o.discard_reason,
        false AS window_end
 FROM (SELECT event_id, created_at, published_at, dead_at, dead_reason, job, attempts,
              last_error, last_attempt_at, discarded_at, discard_reason
       FROM @outbox@
       WHERE dead_at IS NOT NULL AND discarded_at IS NULL
         AND (dead_at, event_id) < (coalesce($3::timestamptz, 'infinity'),
                                    coalesce($9::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
       ORDER BY dead_at DESC, event_id DESC  -- the index's order, backwards
       LIMIT $10) AS o
 WHERE o.dead_at >= coalesce($1::timestamptz, '-infinity')
   AND o.dead_at < coalesce($2::timestamptz, 'infinity')
   AND @dead_letter_filters@
 ORDER BY o.dead_at DESC, o.event_id DESC
 LIMIT $4)
UNION ALL
(SELECT e.event_id::text, NULL, NULL, e.dead_at, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
        NULL, true
 FROM @outbox@ AS e
 WHERE e.dead_at IS NOT NULL AND e.discarded_at IS NULL
   AND (e.dead_at, e.event_id) < (coalesce($3::timestamptz, 'infinity'),
                                  coalesce($9::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'))
 ORDER BY e.dead_at DESC, e.event_id DESC  -- the uuid column, not the text output column
 OFFSET $10 - 1
 LIMIT 1);

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
-- The audit rows naming an event, oldest first: an index range of relayd_audit_rows (every
-- row of every action since migration 0012, and the ids the trail listed before it), at
-- most $3.
-- params: $1 outbox table text, $2 event id uuid, $3 most rows int
SELECT a.id, a.at, a.actor, a.action, a.filters::text AS filters, a.row_count, a.reason
FROM @schema@.relayd_audit_rows AS r
JOIN @schema@.relayd_audit AS a ON a.id = r.audit_id
WHERE r.event_id = $2::uuid AND a.outbox_table = $1
ORDER BY a.id
LIMIT $3;

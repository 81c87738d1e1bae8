-- Parked keys: what `relayd keys` reads and changes (relayd/store/keys.py), and the part of
-- `relayd status` that lists them. A key is parked when its head (its pending row with the
-- lowest ordering_seq) exhausted its attempts or was refused for good on a route that parks
-- (settle_parked in cycle.sql): the head waits at available_at 'infinity' and the ordered
-- claim skips the key while its row of relayd_parked_keys exists. Deleting that row is what
-- lets the claim take the key's head again.
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

-- name: ordering_schema
-- Whether the outbox has ordered delivery (migration 0011): the numbered keys and the parked
-- keys' table. Looked for in the catalogs, as operator_schema does.
-- params: $1 schema text, $2 table text
SELECT to_regclass(format('%I.relayd_parked_keys', $1::text)) IS NOT NULL
       AND EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = to_regclass(format('%I.%I', $1::text, $2::text))
                     AND attname = 'ordering_seq' AND NOT attisdropped);

-- name: keys_list
-- `relayd keys list`: the parked keys of this outbox, parked longest first, with the row that
-- parked each (its state and attempts) and how many other rows of the key wait, counted up to
-- $4 through the key index (ordering_key, ordering_seq of pending rows, migration 0011): one
-- short range of it per key, never a count over the outbox.
-- params: $1 outbox table text, $2 route (event type) text|null, $3 limit int,
--         $4 rows counted per key at most int
SELECT p.ordering_key, p.type, p.event_id::text AS event_id, p.reason, p.error, p.parked_at,
       (extract(epoch FROM now()) - extract(epoch FROM p.parked_at))::float8 AS parked_age_s,
       CASE WHEN h.event_id IS NULL THEN 'missing'
            WHEN h.published_at IS NOT NULL THEN 'published'
            WHEN h.dead_at IS NOT NULL THEN 'dead'
            ELSE 'pending'
       END AS head_state,
       h.attempts, h.last_attempt_at,
       (SELECT count(*)
        FROM (SELECT 1
              FROM @outbox@ AS o
              WHERE o.ordering_key = p.ordering_key AND o.ordering_key IS NOT NULL
                AND o.published_at IS NULL AND o.dead_at IS NULL
                AND o.event_id <> p.event_id
              ORDER BY o.ordering_key, o.ordering_seq
              LIMIT $4) AS counted) AS waiting
FROM @schema@.relayd_parked_keys AS p
LEFT JOIN @outbox@ AS h ON h.event_id = p.event_id
WHERE p.outbox_table = $1 AND p.destination = ''
  AND ($2::text IS NULL OR p.type = $2)
ORDER BY p.parked_at, p.ordering_key
LIMIT $3;

-- name: key_unpark
-- The first step of every action on a parked key: its park lifted, returned as it was, or
-- nothing if the key is not parked. The DELETE locks the row: a second operator acting on
-- the same key at once waits for this transaction, then finds nothing and is refused, so
-- that only one action is taken on one park.
-- params: $1 outbox table text, $2 key text
DELETE FROM @schema@.relayd_parked_keys
WHERE outbox_table = $1 AND destination = '' AND ordering_key = $2
RETURNING event_id::text AS event_id, type, reason, error, parked_at;

-- name: key_head
-- The row that parked the key, locked until the action's transaction ends (nothing: it is
-- gone).
-- params: $1 event id uuid
SELECT event_id::text AS event_id, attempts, last_error, last_attempt_at,
       published_at IS NOT NULL AS published, dead_at IS NOT NULL AS dead
FROM @outbox@
WHERE event_id = $1::uuid
FOR UPDATE;

-- name: key_retry
-- `relayd keys retry`: the head gets its attempts back and stays at available_at 'infinity',
-- where the ordered claim takes a key's head once the key is not parked. last_attempt_at is
-- kept: its next attempt reconciles (or reads back) before it sends again, as a redriven
-- dead letter's does (C2). redriven_at records the operator's decision, as dlq_redrive
-- does: a NATS route in window mode sends it even past the stream's duplicate window.
-- params: $1 event id uuid
UPDATE @outbox@
SET attempts = 0,
    available_at = 'infinity',
    redriven_at = clock_timestamp()
WHERE event_id = $1::uuid AND published_at IS NULL AND dead_at IS NULL
RETURNING attempts, last_error;

-- name: key_skip
-- `relayd keys skip`: the head is dead-lettered with the reason that parked its key, its
-- last_error kept behind the operator's mark; the key's next row becomes its head. The lease
-- is cleared, so that a late settle of an old claim changes nothing (C3).
-- params: $1 event id uuid, $2 dead reason text, $3 last error text
UPDATE @outbox@
SET dead_at = now(),
    dead_reason = $2,
    last_error = $3,
    lease_owner = NULL
WHERE event_id = $1::uuid AND published_at IS NULL AND dead_at IS NULL
RETURNING attempts, last_error;

-- The backlog as operators see it: the sampler's gauges, `relayd status`, relay heartbeats
-- (relayd/store/sampling.py).
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

-- name: backlog_sample
-- The backlog by state, for the sampler's gauges and `relayd status`: one statement every
-- metrics.sample_interval_s, never per row. Each scan is bounded: it reads at most $2 entries
-- of an index in order (the claim index for pending rows, the dead-letter index for dead
-- ones), so its cost does not grow with the backlog; above the bound the caller falls back
-- to PostgreSQL's estimate of the index's rows (reltuples, from the last VACUUM or ANALYZE).
-- - due_rows: pending rows whose available_at has passed, among the first $2;
-- - held_rows: those of them a pause holds (relayd_held(); a pause of every queue and type
--   holds them all). A row's queue and type are computed only while a pause of some queue
--   or type alone is in force, as in the claim;
-- - future_rows: pending rows not due yet, among the first $2 (from the index alone);
-- - leased_rows: those a claim holds (lease_owner set). A claim moves available_at to
--   now() + relay.lease_s, so every lease ends within $3 seconds: only the rows due in that
--   window are read from the table (lease_window_rows of them, at most $2), not the rows
--   in longer backoffs, which may be millions during a sink outage;
-- - dead_rows: dead letters not discarded, among the first $2;
-- - oldest_claimable_age_s: now - available_at of the first row the claim would take: the
--   claim's own predicate and order, pauses included, so a row in backoff never counts;
-- - oldest_pending_age_s: now - created_at of the oldest pending row (the index of 0003);
-- - parked_routes, parked_keys: the parked keys of ordered delivery (migration 0011), per
--   route (the event type of the head that parked each), and oldest_parked_age_s, now -
--   parked_at of the key parked longest. relayd_parked_keys holds a row per parked key, a
--   small table: read whole.
-- Ages use epoch arithmetic, like the claim: a time parked at +/-infinity gives an infinite
-- age instead of failing the statement. They are NULL when there is no such row.
-- params: $1 outbox table text, $2 bound int (rows read per scan at most),
--         $3 lease window float8 (relay.lease_s)
WITH pauses AS (
    -- The three sets of relayd_held(), as the claim reads them.
    SELECT count(*) > 0 AS any_paused,
           coalesce(bool_or(queue = '*' AND type = '*'), false) AS all_paused,
           coalesce(array_agg(queue) FILTER (WHERE type = '*'), '{}') AS queues,
           coalesce(array_agg(type) FILTER (WHERE queue = '*'), '{}') AS types,
           coalesce(array_agg(queue || ' ' || type)
                        FILTER (WHERE queue <> '*' AND type <> '*'), '{}') AS pairs
    FROM @schema@.relayd_pauses
    WHERE outbox_table = $1
),
due AS (
    SELECT count(*) AS n
    FROM (SELECT 1
          FROM @outbox@
          WHERE published_at IS NULL AND dead_at IS NULL AND available_at <= now()
          ORDER BY available_at, event_id
          LIMIT $2) AS sampled
),
held AS (
    SELECT CASE
               WHEN NOT p.any_paused THEN 0
               WHEN p.all_paused THEN due.n
               ELSE (SELECT count(*)
                     FROM (SELECT job
                           FROM @outbox@
                           WHERE published_at IS NULL AND dead_at IS NULL AND available_at <= now()
                           ORDER BY available_at, event_id
                           LIMIT $2) AS sampled
                     WHERE @schema@.relayd_held(sampled.job, p.queues, p.types, p.pairs))
           END AS n
    FROM pauses AS p, due
),
future AS (
    SELECT count(*) AS n
    FROM (SELECT 1
          FROM @outbox@
          WHERE published_at IS NULL AND dead_at IS NULL AND available_at > now()
          ORDER BY available_at, event_id
          LIMIT $2) AS sampled
),
leases AS (
    SELECT count(*) AS n, count(*) FILTER (WHERE lease_owner IS NOT NULL) AS leased
    FROM (SELECT lease_owner
          FROM @outbox@
          WHERE published_at IS NULL AND dead_at IS NULL AND available_at > now()
            AND available_at <= now() + make_interval(secs => $3)
          ORDER BY available_at, event_id
          LIMIT $2) AS sampled
),
dead AS (
    SELECT count(*) AS n
    FROM (SELECT 1
          FROM @outbox@
          WHERE dead_at IS NOT NULL AND discarded_at IS NULL
          ORDER BY dead_at, event_id
          LIMIT $2) AS sampled
),
claimable AS (
    SELECT available_at
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL AND available_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM @schema@.relayd_pauses
          WHERE outbox_table = $1 AND queue = '*' AND type = '*')
      AND (NOT EXISTS (SELECT 1 FROM @schema@.relayd_pauses WHERE outbox_table = $1)
           OR NOT @schema@.relayd_held(job,
               ARRAY(SELECT queue FROM @schema@.relayd_pauses
                     WHERE outbox_table = $1 AND type = '*'),
               ARRAY(SELECT type FROM @schema@.relayd_pauses
                     WHERE outbox_table = $1 AND queue = '*'),
               ARRAY(SELECT queue || ' ' || type FROM @schema@.relayd_pauses
                     WHERE outbox_table = $1 AND queue <> '*' AND type <> '*')))
    ORDER BY available_at, event_id
    LIMIT 1
),
oldest_pending AS (
    SELECT created_at
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL
    ORDER BY created_at
    LIMIT 1
),
parked AS (
    SELECT coalesce(array_agg(type ORDER BY type), '{}') AS routes,
           coalesce(array_agg(keys ORDER BY type), '{}') AS keys,
           min(since) AS since
    FROM (SELECT type, count(*) AS keys, min(parked_at) AS since
          FROM @schema@.relayd_parked_keys
          WHERE outbox_table = $1
          GROUP BY type) AS by_route
)
SELECT due.n AS due_rows,
       held.n AS held_rows,
       future.n AS future_rows,
       leases.leased AS leased_rows,
       leases.n AS lease_window_rows,
       dead.n AS dead_rows,
       (SELECT reltuples::float8 FROM pg_class
        WHERE oid = to_regclass('@schema@."@name@_relayd_claim"')) AS pending_estimate,
       (SELECT reltuples::float8 FROM pg_class
        WHERE oid = to_regclass('@schema@."@name@_relayd_dead"')) AS dead_estimate,
       (SELECT (extract(epoch FROM now()) - extract(epoch FROM available_at))::float8
        FROM claimable) AS oldest_claimable_age_s,
       (SELECT (extract(epoch FROM now()) - extract(epoch FROM created_at))::float8
        FROM oldest_pending) AS oldest_pending_age_s,
       pauses.any_paused AS paused,
       parked.routes AS parked_routes,
       parked.keys AS parked_keys,
       (extract(epoch FROM now()) - extract(epoch FROM parked.since))::float8
           AS oldest_parked_age_s,
       now() AS sampled_at
FROM pauses, due, held, future, leases, dead, parked;

-- name: backlog_top
-- `relayd status`: the queues and types with the most pending rows among the first $1 in
-- claim order (bounded like the sampler), $2 of each. sampled_rows says how many were read.
-- params: $1 bound int, $2 how many queues and types int
WITH sampled AS (
    SELECT @schema@.relayd_effective_queue(job) AS queue,
           coalesce(job ->> 'type', '') AS type
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL
    ORDER BY available_at, event_id
    LIMIT $1
)
SELECT kind, name, rows, (SELECT count(*) FROM sampled) AS sampled_rows
FROM ((SELECT 'queue' AS kind, queue AS name, count(*) AS rows
       FROM sampled GROUP BY queue ORDER BY rows DESC, name LIMIT $2)
      UNION ALL
      (SELECT 'type', type, count(*)
       FROM sampled GROUP BY type ORDER BY 3 DESC, 2 LIMIT $2)) AS top
ORDER BY kind, rows DESC, name;

-- name: dead_by_reason
-- `relayd status`: dead letters not discarded by dead_reason, over the oldest $1 of them
-- (the dead-letter index of 0003, in order).
-- params: $1 bound int
SELECT coalesce(dead_reason, '') AS reason, count(*) AS rows
FROM (SELECT dead_reason
      FROM @outbox@
      WHERE dead_at IS NOT NULL AND discarded_at IS NULL
      ORDER BY dead_at, event_id
      LIMIT $1) AS sampled
GROUP BY 1
ORDER BY rows DESC, reason;

-- name: pauses_held
-- `relayd status`: for each pause of this outbox, how many of the first $2 due rows in claim
-- order it holds: the rows backlog_sample counts as paused (held_rows), read the same way,
-- so that a lone pause holds exactly the backlog's paused rows. A row in a backoff, or
-- leased, is counted by its own state, held or not. Bounded like the sampler: the first $2
-- due entries of the claim index are read once, whatever the number of pauses. Pauses of
-- every queue and type included.
-- params: $1 outbox table text, $2 bound int
WITH sampled AS (
    SELECT @schema@.relayd_effective_queue(job) AS queue, coalesce(job ->> 'type', '') AS type
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL AND available_at <= now()
    ORDER BY available_at, event_id
    LIMIT $2
)
SELECT p.queue, p.type,
       (SELECT count(*) FROM sampled AS s
        WHERE (p.queue = '*' OR s.queue = p.queue) AND (p.type = '*' OR s.type = p.type))
           AS rows
FROM @schema@.relayd_pauses AS p
WHERE p.outbox_table = $1;

-- name: parked_keys_oldest
-- `relayd status` and `/v1/status`: the $2 keys of this outbox parked longest (their count,
-- per route, comes with backlog_sample).
-- params: $1 outbox table text, $2 how many int
SELECT ordering_key, type, reason, parked_at,
       (extract(epoch FROM now()) - extract(epoch FROM parked_at))::float8 AS age_s
FROM @schema@.relayd_parked_keys
WHERE outbox_table = $1
ORDER BY parked_at, ordering_key
LIMIT $2;

-- name: instances_list
-- The relays that kept a heartbeat for this outbox within the last day (older rows are
-- leftovers of relays that died; the next heartbeat of any relay prunes them), with the age
-- of their last heartbeat by the database's clock.
-- params: $1 outbox table text
SELECT instance_id::text AS instance_id, host, pid, version, started_at, last_seen,
       (extract(epoch FROM now()) - extract(epoch FROM last_seen))::float8 AS last_seen_age_s,
       breaker_state, breaker_reason, in_flight, housekeeping::text AS housekeeping
FROM @schema@.relayd_instances
WHERE outbox_table = $1 AND last_seen > now() - interval '1 day'
ORDER BY started_at, instance_id;

-- name: heartbeat
-- A running relay's heartbeat: insert or refresh its row (last_seen is the database's
-- clock, so ages compare across hosts), and prune rows not refreshed for a day.
-- housekeeping: its chores failing now ({"cleanup": {"error": ..., "since": ...}}; {} when
-- none is). breaker_reason: why its breaker is not closed, in the sink's words (NULL:
-- closed).
-- params: $1 outbox table text, $2 instance id uuid, $3 host text, $4 pid int,
--         $5 version text, $6 started_at timestamptz, $7 breaker state text, $8 in flight int,
--         $9 housekeeping jsonb (as text), $10 breaker reason text (NULL: closed)
WITH pruned AS (
    DELETE FROM @schema@.relayd_instances
    WHERE outbox_table = $1 AND last_seen < now() - interval '1 day'
)
INSERT INTO @schema@.relayd_instances AS i
    (outbox_table, instance_id, host, pid, version, started_at, last_seen, breaker_state,
     in_flight, housekeeping, breaker_reason)
VALUES ($1, $2, $3, $4, $5, $6, now(), $7, $8, $9::jsonb, $10)
ON CONFLICT (outbox_table, instance_id) DO UPDATE
SET last_seen = now(),
    breaker_state = excluded.breaker_state,
    in_flight = excluded.in_flight,
    housekeeping = excluded.housekeeping,
    breaker_reason = excluded.breaker_reason;

-- name: heartbeat_delete
-- A relay that stops cleanly removes its heartbeat.
-- params: $1 outbox table text, $2 instance id uuid
DELETE FROM @schema@.relayd_instances
WHERE outbox_table = $1 AND instance_id = $2;

-- relayd's SQL, one named block per statement; relayd/store.py has one method per name.
-- @outbox@ and @schema@ are replaced once at start-up by the validated, quoted identifiers.
-- asyncpg binds by position: each block lists its parameters.

-- name: claim
-- Lease up to $1 due rows to a fresh owner token for $3 seconds, in one autocommitted
-- statement. SKIP LOCKED lets concurrent claimers (workers, replicas) take disjoint rows;
-- the lease lives in available_at, so an abandoned claim is due again when it expires.
-- previous_attempt_at is the value before this claim: non-null means an earlier attempt may
-- have reached the sink, so the relay reconciles with a GET before it POSTs again.
-- Paused queues are skipped, so every replica obeys a pause from its next claim. The pause
-- checks are uncorrelated subqueries, evaluated once per statement: with nothing paused the
-- queue of a row is never computed, and with everything paused ('*') nothing is scanned.
-- params: $1 limit int, $2 owner token uuid, $3 lease_s float8, $4 outbox table text
WITH due AS (
    SELECT event_id, last_attempt_at
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL AND available_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM @schema@.relayd_pauses WHERE outbox_table = $4 AND queue = '*')
      AND (NOT EXISTS (SELECT 1 FROM @schema@.relayd_pauses WHERE outbox_table = $4)
           OR @schema@.relayd_effective_queue(job) <> ALL (ARRAY(
               SELECT queue FROM @schema@.relayd_pauses WHERE outbox_table = $4)))
    ORDER BY available_at, event_id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE @outbox@ AS o
SET lease_owner = $2,
    available_at = now() + make_interval(secs => $3),
    attempts = o.attempts + 1,
    last_attempt_at = now()
FROM due
WHERE o.event_id = due.event_id
RETURNING o.event_id::text AS event_id,
          convert_to(o.job::text, 'UTF8') AS job,  -- the request body, as bytes
          o.attempts,
          due.last_attempt_at AS previous_attempt_at,
          -- Epoch arithmetic, not timestamp subtraction: an infinite created_at (the
          -- producer's column) gives an infinite age instead of failing the whole claim.
          (extract(epoch FROM clock_timestamp()) - extract(epoch FROM o.created_at))::float8
              AS age_s;

-- name: settle_published
-- Mark rows the sink accepted. Fenced: only the claim's owner token may settle (C3).
-- params: $1 owner token uuid, $2 event ids uuid[], $3 sink states text[]
UPDATE @outbox@ AS o
SET published_at = now(),
    lease_owner = NULL,
    sink_state = r.sink_state
FROM unnest($2::uuid[], $3::text[]) AS r(event_id, sink_state)
WHERE o.event_id = r.event_id AND o.lease_owner = $1
RETURNING o.event_id::text;

-- name: settle_retry
-- Schedule another attempt after a backoff; refund the attempt when the failure was the
-- sink's, not the row's (C5). Fenced by the owner token.
-- params: $1 owner token uuid, $2 event ids uuid[], $3 delays float8[] (seconds),
--         $4 errors text[], $5 refunds int[] (0 or 1)
UPDATE @outbox@ AS o
SET lease_owner = NULL,
    available_at = now() + make_interval(secs => r.delay_s),
    last_error = r.error,
    attempts = greatest(o.attempts - r.refund, 0)
FROM unnest($2::uuid[], $3::float8[], $4::text[], $5::int[]) AS r(event_id, delay_s, error, refund)
WHERE o.event_id = r.event_id AND o.lease_owner = $1
RETURNING o.event_id::text;

-- name: settle_dead
-- Dead-letter rows that can never succeed or exhausted their attempts (C6). Fenced.
-- params: $1 owner token uuid, $2 event ids uuid[], $3 reasons text[], $4 errors text[]
UPDATE @outbox@ AS o
SET lease_owner = NULL,
    dead_at = now(),
    dead_reason = r.reason,
    last_error = r.error
FROM unnest($2::uuid[], $3::text[], $4::text[]) AS r(event_id, reason, error)
WHERE o.event_id = r.event_id AND o.lease_owner = $1
RETURNING o.event_id::text;

-- name: release
-- Give back claimed rows whose attempt never started (drain, open breaker): due at once for
-- any replica, the attempt refunded and the previous attempt time restored, so a row that
-- never reached the sink is not reconciled needlessly. Fenced.
-- params: $1 owner token uuid, $2 event ids uuid[], $3 previous attempt times timestamptz[]
UPDATE @outbox@ AS o
SET lease_owner = NULL,
    available_at = now(),
    attempts = greatest(o.attempts - 1, 0),
    last_attempt_at = r.previous_attempt_at
FROM unnest($2::uuid[], $3::timestamptz[]) AS r(event_id, previous_attempt_at)
WHERE o.event_id = r.event_id AND o.lease_owner = $1
RETURNING o.event_id::text;

-- name: next_due_s
-- Seconds until the earliest pending row is due (negative if one is due now), or NULL when
-- nothing is pending. Reads the first entry of the claim index. Epoch arithmetic keeps a
-- row parked by hand at 'infinity' (or '-infinity') from failing the query: +/-Infinity.
-- params: none
SELECT (extract(epoch FROM available_at) - extract(epoch FROM now()))::float8
FROM @outbox@
WHERE published_at IS NULL AND dead_at IS NULL
ORDER BY available_at, event_id
LIMIT 1;

-- name: delete_published
-- Retention: delete at most $2 rows published more than $1 seconds ago. Dead rows are
-- never deleted (C7). Small batches keep locks and WAL bursts short.
-- params: $1 retention_s float8, $2 limit int
DELETE FROM @outbox@
WHERE event_id IN (
    SELECT event_id
    FROM @outbox@
    WHERE published_at IS NOT NULL
      AND published_at < now() - make_interval(secs => $1)
    ORDER BY published_at
    LIMIT $2
);

-- name: outbox_columns
-- The relay columns present on the outbox table, to tell "not migrated" from ready.
-- params: $1 schema text, $2 table text
SELECT column_name::text
FROM information_schema.columns
WHERE table_schema = $1 AND table_name = $2;

-- name: migrations_lock
-- Serialise concurrent `relayd migrate` runs on one outbox until the transaction ends.
-- params: $1 outbox table text
SELECT pg_advisory_xact_lock(hashtext('relayd.migrate'), hashtext($1));

-- name: migrations_schema_create
-- The outbox's schema, created under the migration lock before the ledger that lives in it.
-- params: none
CREATE SCHEMA IF NOT EXISTS @schema@;

-- name: migrations_ledger_create
-- The ledger of applied migrations, one row per (outbox table, version).
-- params: none
CREATE TABLE IF NOT EXISTS @schema@.relayd_migrations (
    outbox_table text        NOT NULL,
    version      integer     NOT NULL,
    name         text        NOT NULL,
    checksum     text        NOT NULL,
    applied_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (outbox_table, version)
);

-- name: migrations_applied
-- The migrations already applied to this outbox.
-- params: $1 outbox table text
SELECT version, name, checksum, applied_at
FROM @schema@.relayd_migrations
WHERE outbox_table = $1
ORDER BY version;

-- name: migrations_record
-- Record one applied migration.
-- params: $1 outbox table text, $2 version int, $3 name text, $4 checksum text
INSERT INTO @schema@.relayd_migrations (outbox_table, version, name, checksum)
VALUES ($1, $2, $3, $4);

-- name: ping
-- Readiness: the database answers.
-- params: none
SELECT 1;

-- ============================================================================================
-- The backlog as operators see it: the sampler's gauges, `relayd status`, relay heartbeats.
-- ============================================================================================

-- name: backlog_sample
-- The backlog by state, for the sampler's gauges and `relayd status`: one statement every
-- metrics.sample_interval_s, never per row. Each scan is bounded: it reads at most $2 entries
-- of an index in order (the claim index for pending rows, the dead-letter index for dead
-- ones), so its cost does not grow with the backlog; above the bound the caller falls back
-- to PostgreSQL's estimate of the index's rows (reltuples, from the last VACUUM or ANALYZE).
-- - due_rows: pending rows whose available_at has passed, among the first $2;
-- - held_rows: those of them in a paused queue (a '*' pause holds them all). The queue of a
--   row is computed only while some queue alone is paused, as in the claim;
-- - future_rows: pending rows not due yet, among the first $2 (from the index alone);
-- - leased_rows: those a claim holds (lease_owner set). A claim moves available_at to
--   now() + relay.lease_s, so every lease ends within $3 seconds: only the rows due in that
--   window are read from the table (lease_window_rows of them, at most $2), not the rows
--   in longer backoffs, which may be millions during a sink outage;
-- - dead_rows: dead letters not discarded, among the first $2;
-- - oldest_claimable_age_s: now - available_at of the first row the claim would take: the
--   claim's own predicate and order, pauses included, so a row in backoff never counts;
-- - oldest_pending_age_s: now - created_at of the oldest pending row (the index of 0003).
-- Ages use epoch arithmetic, like the claim: a time parked at +/-infinity gives an infinite
-- age instead of failing the statement. They are NULL when there is no such row.
-- params: $1 outbox table text, $2 bound int (rows read per scan at most),
--         $3 lease window float8 (relay.lease_s)
WITH pauses AS (
    SELECT count(*) > 0 AS any_paused,
           coalesce(bool_or(queue = '*'), false) AS all_paused,
           coalesce(array_agg(queue), '{}') AS queues
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
                     WHERE @schema@.relayd_effective_queue(sampled.job) = ANY (p.queues))
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
          SELECT 1 FROM @schema@.relayd_pauses WHERE outbox_table = $1 AND queue = '*')
      AND (NOT EXISTS (SELECT 1 FROM @schema@.relayd_pauses WHERE outbox_table = $1)
           OR @schema@.relayd_effective_queue(job) <> ALL (ARRAY(
               SELECT queue FROM @schema@.relayd_pauses WHERE outbox_table = $1)))
    ORDER BY available_at, event_id
    LIMIT 1
),
oldest_pending AS (
    SELECT created_at
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL
    ORDER BY created_at
    LIMIT 1
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
       now() AS sampled_at
FROM pauses, due, held, future, leases, dead;

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

-- name: pauses_list
-- Every pause of this outbox, oldest first.
-- params: $1 outbox table text
SELECT queue, reason, paused_by, paused_at
FROM @schema@.relayd_pauses
WHERE outbox_table = $1
ORDER BY paused_at, queue;

-- name: instances_list
-- The relays that kept a heartbeat for this outbox within the last day (older rows are
-- leftovers of relays that died; the next heartbeat of any relay prunes them), with the age
-- of their last heartbeat by the database's clock.
-- params: $1 outbox table text
SELECT instance_id::text AS instance_id, host, pid, version, started_at, last_seen,
       (extract(epoch FROM now()) - extract(epoch FROM last_seen))::float8 AS last_seen_age_s,
       breaker_state, in_flight
FROM @schema@.relayd_instances
WHERE outbox_table = $1 AND last_seen > now() - interval '1 day'
ORDER BY started_at, instance_id;

-- name: heartbeat
-- A running relay's heartbeat: insert or refresh its row (last_seen is the database's
-- clock, so ages compare across hosts), and prune rows not refreshed for a day.
-- params: $1 outbox table text, $2 instance id uuid, $3 host text, $4 pid int,
--         $5 version text, $6 started_at timestamptz, $7 breaker state text, $8 in flight int
WITH pruned AS (
    DELETE FROM @schema@.relayd_instances
    WHERE outbox_table = $1 AND last_seen < now() - interval '1 day'
)
INSERT INTO @schema@.relayd_instances AS i
    (outbox_table, instance_id, host, pid, version, started_at, last_seen, breaker_state,
     in_flight)
VALUES ($1, $2, $3, $4, $5, $6, now(), $7, $8)
ON CONFLICT (outbox_table, instance_id) DO UPDATE
SET last_seen = now(),
    breaker_state = excluded.breaker_state,
    in_flight = excluded.in_flight;

-- name: heartbeat_delete
-- A relay that stops cleanly removes its heartbeat.
-- params: $1 outbox table text, $2 instance id uuid
DELETE FROM @schema@.relayd_instances
WHERE outbox_table = $1 AND instance_id = $2;

-- ============================================================================================
-- Dead letters, pauses and the audit trail: `relayd dlq`, `relayd pause`, `relayd resume`,
-- and the poison-storm guard's pause.
-- ============================================================================================

-- ============================================================================================
-- The outbox's health in the database: `relayd check`, `relayd doctor`.
-- ============================================================================================

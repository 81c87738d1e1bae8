-- relayd's SQL, one named block per statement; relayd/store/ has one method per name.
-- @outbox@ and @schema@ are replaced once at start-up by the validated, quoted identifiers.
-- asyncpg binds by position: each block lists its parameters.

-- name: claim
-- Lease up to $1 due rows to a fresh owner token for $3 seconds, in one autocommitted
-- statement. SKIP LOCKED lets concurrent claimers (workers, replicas) take disjoint rows;
-- the lease lives in available_at, so an abandoned claim is due again when it expires.
-- previous_attempt_at is the value before this claim: non-null means an earlier attempt may
-- have reached the sink, so the relay reconciles with a GET before it POSTs again.
-- redriven says an operator redrove the row (`relayd dlq retry`) after its last attempt:
-- this attempt is the one the operator asked for (a NATS route in window mode re-sends it
-- even past the stream's duplicate window). The claim sets last_attempt_at past
-- redriven_at, so only the first attempt after a redrive sees it; a release, which restores
-- last_attempt_at, gives it back.
-- Paused queues and types are skipped, so every replica obeys a pause from its next claim.
-- The pause checks are uncorrelated subqueries, evaluated once per statement: with nothing
-- paused the queue and type of a row are never computed, and with everything paused ('*'
-- queue, '*' type) nothing is scanned. The same checks stand in next_due_s and
-- backlog_sample: a row the claim skips must neither wake a worker nor count as claimable.
--
-- The scan starts at $5 (NULL: at the start of the index), the watermark the relay keeps
-- (docs/performance.md): below it lie only index entries of rows already published or
-- dead-lettered, which vacuum cannot remove while an old snapshot holds the xmin horizon
-- back, and which a scan from the start would step over on every claim. Each answer carries
-- what the next watermark is made of: `head`, the smallest available_at of the pending rows
-- from $5 on (leased, scheduled or paused ones too), and `writers_since`, the start of the
-- oldest transaction of this database that has written something and not ended (its rows
-- were stamped no earlier: the default relayd_available_at() stamps a row once its
-- transaction is a writer; NULL if a writer's start is hidden from this role). With no writer it is
-- this statement's start, not the time pg_stat_activity was read: a transaction that became
-- a writer after that read stamps its rows later than the statement's start, but perhaps
-- earlier than the end of the read. They arrive on one extra row whose claim columns are NULL (last, though nothing
-- orders the two parts; the caller looks for it), so that a claim of 100 rows does not
-- send and decode the same two timestamps 100 times.
--
-- The claim is durable whatever the session's settings: `durable` lifts synchronous_commit
-- from off to on for this statement's own transaction (a stronger setting, such as
-- remote_apply, is kept), so the claim is on disk before any request leaves. A claim a
-- database crash forgot would send its rows again with no GET first (docs/contract.md, C1).
-- The settles below do the opposite, on purpose.
-- params: $1 limit int, $2 owner token uuid, $3 lease_s float8, $4 outbox table text,
--         $5 scan from timestamptz (NULL: the whole index)
WITH durable AS (
    SELECT CASE WHEN current_setting('synchronous_commit') = 'off'
                THEN set_config('synchronous_commit', 'on', true) END
),
marks AS (
    -- Finite values only: a row parked at 'infinity' bounds nothing, and one at
    -- '-infinity' is claimed by the next full scan.
    SELECT (SELECT min(available_at) FROM @outbox@
            WHERE published_at IS NULL AND dead_at IS NULL
              AND available_at >= coalesce($5::timestamptz, '-infinity')
              AND available_at > '-infinity' AND available_at < 'infinity') AS head,
           -- NULL when a writer's start is hidden from us (another role's session, without
           -- pg_read_all_stats): nothing is known, and the next claim reads the whole index.
           (SELECT CASE WHEN bool_or(xact_start IS NULL) THEN NULL
                        ELSE coalesce(min(xact_start), now()) END
            FROM pg_stat_activity
            WHERE backend_xid IS NOT NULL AND datname = current_database()
              AND pid <> pg_backend_pid()) AS writers_since
),
due AS (
    SELECT event_id, last_attempt_at, redriven_at
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL
      AND available_at >= coalesce($5::timestamptz, '-infinity') AND available_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM @schema@.relayd_pauses
          WHERE outbox_table = $4 AND queue = '*' AND type = '*')
      AND (NOT EXISTS (SELECT 1 FROM @schema@.relayd_pauses WHERE outbox_table = $4)
           OR NOT @schema@.relayd_held(job,
               ARRAY(SELECT queue FROM @schema@.relayd_pauses
                     WHERE outbox_table = $4 AND type = '*'),
               ARRAY(SELECT type FROM @schema@.relayd_pauses
                     WHERE outbox_table = $4 AND queue = '*'),
               ARRAY(SELECT queue || ' ' || type FROM @schema@.relayd_pauses
                     WHERE outbox_table = $4 AND queue <> '*' AND type <> '*')))
    ORDER BY available_at, event_id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
claimed AS (
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
                  AS age_s,
              due.redriven_at IS NOT NULL
                  AND due.redriven_at > coalesce(due.last_attempt_at, '-infinity') AS redriven
)
SELECT claimed.*, NULL::timestamptz AS head, NULL::timestamptz AS writers_since
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, marks.head, marks.writers_since
FROM marks, durable;

-- fragment: lazy_commit
-- Every settle (settle_published, settle_retry, settle_dead, release) begins with
-- `WITH lazy AS @lazy_commit@` and joins `lazy` in its last SELECT, so that it is evaluated:
-- synchronous_commit off for the statement's own transaction, whose commit then returns
-- without waiting for the WAL flush. A settle a database crash forgets leaves its rows
-- claimed, as the durable claim recorded them: they fall due when the lease expires and the
-- next attempt reconciles before it sends again (docs/contract.md, C1). A claim never does
-- this: it must be on disk before a request leaves. Any later durable commit (the next
-- claim) flushes the WAL up to itself, settles included.
SELECT set_config('synchronous_commit', 'off', true)

-- name: settle_published
-- Mark rows the sink accepted. Fenced: only the claim's owner token may settle (C3).
-- Lazy commit (the fragment lazy_commit says why).
-- params: $1 owner token uuid, $2 event ids uuid[], $3 sink states text[]
-- Returns NULL when every row was still this owner's (the usual case: nothing to decode),
-- else the ids it did update.
WITH lazy AS @lazy_commit@,
settled AS (
    UPDATE @outbox@ AS o
    SET published_at = now(),
        lease_owner = NULL,
        sink_state = r.sink_state
    FROM unnest($2::uuid[], $3::text[]) AS r(event_id, sink_state)
    WHERE o.event_id = r.event_id AND o.lease_owner = $1
    RETURNING o.event_id
)
SELECT CASE WHEN count(*) = cardinality($2::uuid[]) THEN NULL
            ELSE coalesce(array_agg(event_id::text), '{}') END
FROM settled, lazy;

-- name: settle_retry
-- Schedule another attempt after a backoff; refund the attempt when the failure was the
-- sink's, not the row's (C5). Fenced by the owner token. The backoff counts from
-- relayd_available_at(), not now(): a jittered backoff may be a few microseconds, and a row
-- due before this statement shows as a writer could fall below a watermark.
-- params: $1 owner token uuid, $2 event ids uuid[], $3 delays float8[] (seconds),
--         $4 errors text[], $5 refunds int[] (0 or 1)
-- Returns NULL when every row was still this owner's (the usual case: nothing to decode),
-- else the ids it did update.
WITH lazy AS @lazy_commit@,
settled AS (
    UPDATE @outbox@ AS o
    SET lease_owner = NULL,
        available_at = @schema@.relayd_available_at() + make_interval(secs => r.delay_s),
        last_error = r.error,
        attempts = greatest(o.attempts - r.refund, 0)
    FROM unnest($2::uuid[], $3::float8[], $4::text[], $5::int[]) AS r(event_id, delay_s, error, refund)
    WHERE o.event_id = r.event_id AND o.lease_owner = $1
    RETURNING o.event_id
)
SELECT CASE WHEN count(*) = cardinality($2::uuid[]) THEN NULL
            ELSE coalesce(array_agg(event_id::text), '{}') END
FROM settled, lazy;

-- name: settle_dead
-- Dead-letter rows that can never succeed or exhausted their attempts (C6). Fenced.
-- params: $1 owner token uuid, $2 event ids uuid[], $3 reasons text[], $4 errors text[]
-- Returns NULL when every row was still this owner's (the usual case: nothing to decode),
-- else the ids it did update.
WITH lazy AS @lazy_commit@,
settled AS (
    UPDATE @outbox@ AS o
    SET lease_owner = NULL,
        dead_at = now(),
        dead_reason = r.reason,
        last_error = r.error
    FROM unnest($2::uuid[], $3::text[], $4::text[]) AS r(event_id, reason, error)
    WHERE o.event_id = r.event_id AND o.lease_owner = $1
    RETURNING o.event_id
)
SELECT CASE WHEN count(*) = cardinality($2::uuid[]) THEN NULL
            ELSE coalesce(array_agg(event_id::text), '{}') END
FROM settled, lazy;

-- name: release
-- Give back claimed rows whose attempt never started (drain, open breaker): due at once for
-- any replica, the attempt refunded and the previous attempt time restored, so a row that
-- never reached the sink is not reconciled needlessly. Fenced. Due from
-- relayd_available_at(), as a new row is (settle_retry says why).
-- params: $1 owner token uuid, $2 event ids uuid[], $3 previous attempt times timestamptz[]
-- Returns NULL when every row was still this owner's (the usual case: nothing to decode),
-- else the ids it did update.
WITH lazy AS @lazy_commit@,
settled AS (
    UPDATE @outbox@ AS o
    SET lease_owner = NULL,
        available_at = @schema@.relayd_available_at(),
        attempts = greatest(o.attempts - 1, 0),
        last_attempt_at = r.previous_attempt_at
    FROM unnest($2::uuid[], $3::timestamptz[]) AS r(event_id, previous_attempt_at)
    WHERE o.event_id = r.event_id AND o.lease_owner = $1
    RETURNING o.event_id
)
SELECT CASE WHEN count(*) = cardinality($2::uuid[]) THEN NULL
            ELSE coalesce(array_agg(event_id::text), '{}') END
FROM settled, lazy;

-- name: next_due_s
-- Seconds until the earliest pending row the claim may take is due (negative if one is due
-- now), or NULL when there is none. Reads the claim index in order, with the claim's pause
-- checks: a paused row must not wake an idle worker (it would spin, claiming nothing).
-- Epoch arithmetic keeps a row parked by hand at 'infinity' (or '-infinity') from failing
-- the query: +/-Infinity.
-- Scans from the worker's watermark $2, as the claim does.
-- params: $1 outbox table text, $2 scan from timestamptz (NULL: the whole index)
SELECT (extract(epoch FROM available_at) - extract(epoch FROM now()))::float8
FROM @outbox@
WHERE published_at IS NULL AND dead_at IS NULL
  AND available_at >= coalesce($2::timestamptz, '-infinity')
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
-- The relay columns present on the outbox table, to tell "not migrated" from ready. Read from
-- the catalogs, which every role may read: information_schema lists only the columns the
-- role holds a privilege on, and a missing grant would look like a missing table.
-- params: $1 schema text, $2 table text
SELECT a.attname::text AS column_name
FROM pg_attribute AS a
JOIN pg_class AS c ON c.oid = a.attrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped;

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

-- name: notify_trigger_state
-- The outbox's NOTIFY trigger (migration 0001): NULL when it has none, else its
-- pg_trigger.tgenabled ('D': disabled by hand, it never fires).
-- params: $1 outbox table text
SELECT (SELECT tgenabled::text
        FROM pg_trigger
        WHERE tgrelid = to_regclass($1)::oid AND tgname = 'relayd_notify_insert');

-- name: notify_trigger_create
-- One NOTIFY per inserting statement, on the channel 'schema.table' (outbox.notify_trigger
-- = true): created by 0001, again by `relayd migrate` if it was dropped.
-- params: none
CREATE TRIGGER relayd_notify_insert
    AFTER INSERT ON @outbox@
    FOR EACH STATEMENT
    EXECUTE FUNCTION @schema@.relayd_notify_outbox();

-- name: notify_trigger_drop
-- No NOTIFY from producers' inserts (outbox.notify_trigger = false): PostgreSQL refuses
-- PREPARE TRANSACTION in a transaction that notified, so two-phase-commit producers need it
-- gone. Relays then poll.
-- params: none
DROP TRIGGER IF EXISTS relayd_notify_insert ON @outbox@;

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
-- - oldest_pending_age_s: now - created_at of the oldest pending row (the index of 0003).
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

-- name: pauses_held
-- `relayd status`: for each pause of this outbox, how many of the first $2 pending rows in
-- claim order it holds (bounded like the sampler: the first $2 entries of the claim index
-- are read once, whatever the number of pauses). Pauses of every queue and type included.
-- params: $1 outbox table text, $2 bound int
WITH sampled AS (
    SELECT @schema@.relayd_effective_queue(job) AS queue, coalesce(job ->> 'type', '') AS type
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL
    ORDER BY available_at, event_id
    LIMIT $2
)
SELECT p.queue, p.type,
       (SELECT count(*) FROM sampled AS s
        WHERE (p.queue = '*' OR s.queue = p.queue) AND (p.type = '*' OR s.type = p.type))
           AS rows
FROM @schema@.relayd_pauses AS p
WHERE p.outbox_table = $1;

-- name: instances_list
-- The relays that kept a heartbeat for this outbox within the last day (older rows are
-- leftovers of relays that died; the next heartbeat of any relay prunes them), with the age
-- of their last heartbeat by the database's clock.
-- params: $1 outbox table text
SELECT instance_id::text AS instance_id, host, pid, version, started_at, last_seen,
       (extract(epoch FROM now()) - extract(epoch FROM last_seen))::float8 AS last_seen_age_s,
       breaker_state, in_flight, housekeeping::text AS housekeeping
FROM @schema@.relayd_instances
WHERE outbox_table = $1 AND last_seen > now() - interval '1 day'
ORDER BY started_at, instance_id;

-- name: heartbeat
-- A running relay's heartbeat: insert or refresh its row (last_seen is the database's
-- clock, so ages compare across hosts), and prune rows not refreshed for a day.
-- housekeeping: its chores failing now ({"cleanup": {"error": ..., "since": ...}}; {} when
-- none is).
-- params: $1 outbox table text, $2 instance id uuid, $3 host text, $4 pid int,
--         $5 version text, $6 started_at timestamptz, $7 breaker state text, $8 in flight int,
--         $9 housekeeping jsonb (as text)
WITH pruned AS (
    DELETE FROM @schema@.relayd_instances
    WHERE outbox_table = $1 AND last_seen < now() - interval '1 day'
)
INSERT INTO @schema@.relayd_instances AS i
    (outbox_table, instance_id, host, pid, version, started_at, last_seen, breaker_state,
     in_flight, housekeeping)
VALUES ($1, $2, $3, $4, $5, $6, now(), $7, $8, $9::jsonb)
ON CONFLICT (outbox_table, instance_id) DO UPDATE
SET last_seen = now(),
    breaker_state = excluded.breaker_state,
    in_flight = excluded.in_flight,
    housekeeping = excluded.housekeeping;

-- name: heartbeat_delete
-- A relay that stops cleanly removes its heartbeat.
-- params: $1 outbox table text, $2 instance id uuid
DELETE FROM @schema@.relayd_instances
WHERE outbox_table = $1 AND instance_id = $2;

-- ============================================================================================
-- Dead letters, pauses and the audit trail: `relayd dlq`, `relayd pause`, `relayd resume`,
-- and the poison-storm guard's pause.
-- ============================================================================================

-- name: operator_schema
-- Whether the outbox has what the operator commands need (migration 0003): the discard
-- columns, the pauses and the audit trail. The column is looked for in the catalogs (see
-- outbox_columns: information_schema hides what the role holds no privilege on).
-- params: $1 schema text, $2 table text
SELECT to_regclass(format('%I.relayd_pauses', $1::text)) IS NOT NULL
       AND to_regclass(format('%I.relayd_audit', $1::text)) IS NOT NULL
       AND EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = to_regclass(format('%I.%I', $1::text, $2::text))
                     AND attname = 'discarded_at' AND NOT attisdropped);

-- name: operator_now
-- The database's clock: relative times (`--since 2h`) and the end of a bulk walk are counted
-- on the clock that stamped dead_at, not on the operator's host.
-- params: none
SELECT now();

-- fragment: dead_letter_filters
-- The filters of `dlq list` and of the bulk actions (dlq_list, dlq_page), in one place: each
-- null parameter lets every row through. The statements using it read the outbox as `o` and
-- take their own four parameters first, then the filters from $5 on, in the order of
-- `DeadLetterFilter.matching()`: a new filter is a line here, its field there and its option
-- in relayd/operator/dlq_filters.py.
    ($5::text IS NULL OR @schema@.relayd_effective_queue(o.job) = $5)
AND ($6::text IS NULL OR o.job ->> 'type' = $6)
AND ($7::text IS NULL OR o.dead_reason = $7)
AND ($8::text IS NULL OR strpos(lower(o.last_error), lower($8)) > 0)

-- name: dlq_list
-- Dead letters matching the filters, newest first. Without include_discarded the planner
-- (which sees the parameters: the command runs this once) can read the dead-letter index.
-- params: $1 since timestamptz|null, $2 until timestamptz|null, $3 include_discarded bool,
--         $4 limit int, then the dead_letter_filters
SELECT event_id::text AS event_id, created_at, published_at, dead_at, dead_reason,
       @schema@.relayd_effective_queue(job) AS queue, job ->> 'type' AS type, attempts,
       last_error, last_attempt_at, discarded_at, discard_reason
FROM @outbox@ AS o
WHERE dead_at IS NOT NULL
  AND (discarded_at IS NULL OR $3::boolean)
  AND dead_at >= coalesce($1::timestamptz, '-infinity')
  AND dead_at < coalesce($2::timestamptz, 'infinity')
  AND @dead_letter_filters@
ORDER BY o.dead_at DESC, o.event_id DESC  -- the uuid column, not the text output column
LIMIT $4;

-- name: dlq_show
-- One outbox row, whatever its state (to say why it is not a dead letter), with its envelope.
-- params: $1 event id uuid
SELECT event_id::text AS event_id, created_at, published_at, dead_at, dead_reason,
       @schema@.relayd_effective_queue(job) AS queue, job ->> 'type' AS type, attempts,
       last_error, last_attempt_at, discarded_at, discard_reason, job::text AS job
FROM @outbox@
WHERE event_id = $1::uuid;

-- name: dlq_page
-- One batch of a bulk action: the next $4 entries of the dead-letter index after the keyset
-- cursor ($1, $2), in (dead_at, event_id) order, and which of them the filters select
-- (locked until the batch's transaction ends). The scan has no condition but the index's
-- own predicate and the cursor: the planner then always walks the index in order and stops
-- after $4 entries (filters or a range bound on dead_at, whose selectivity it can only
-- guess for a prepared statement, would tempt it into reading and sorting every remaining
-- dead letter, batch after batch). Each batch therefore reads at most $4 entries, however
-- selective the filters: no OFFSET, no long scan, no long lock. --since is the first
-- cursor (with the nil uuid); $3 is the walk's end.
-- params: $1 after dead_at timestamptz, $2 after event_id uuid, $3 until timestamptz,
--         $4 limit int, then the dead_letter_filters
WITH scanned AS (
    SELECT event_id, dead_at
    FROM @outbox@ AS o
    WHERE dead_at IS NOT NULL AND discarded_at IS NULL
      AND (dead_at, event_id) > ($1::timestamptz, $2::uuid)
    ORDER BY o.dead_at, o.event_id  -- the index's order
    LIMIT $4
),
selected AS (
    SELECT o.event_id
    FROM @outbox@ AS o
    JOIN scanned AS s ON s.event_id = o.event_id
    WHERE o.dead_at IS NOT NULL AND o.discarded_at IS NULL  -- again, once locked
      AND o.dead_at < $3::timestamptz
      AND @dead_letter_filters@
    FOR UPDATE OF o
)
SELECT s.event_id::text AS event_id, s.dead_at, sel.event_id IS NOT NULL AS selected
FROM scanned AS s
LEFT JOIN selected AS sel ON sel.event_id = s.event_id
ORDER BY s.dead_at, s.event_id;

-- name: dlq_redrive
-- Make dead letters pending again, so that they are not dead-lettered again at once: due now,
-- no attempt used, no lease, no longer discarded. last_attempt_at is kept on purpose: a row
-- that was ever attempted may already be on the sink (its answer may have been lost), and a
-- non-null last_attempt_at is what makes the next claim reconcile it with a GET before any
-- POST (C2), so it is created at most once even on a sink that overwrites a reused id.
-- redriven_at records the operator's decision: the next claim reports the row as redriven
-- (see claim), so a NATS route in window mode sends it even past the duplicate window
-- instead of dead-lettering it `past_window` again.
-- The table's checks exempt dead rows; a row they would refuse as a pending one is refused
-- here, with the check's name, instead of failing the statement (and its whole batch). The
-- cases follow the checks of migrations 0001-0003 (one function since 0008, under the same
-- names); store/operator.py falls back to one row at a time if a check this list does not know
-- of refuses one.
-- params: $1 event ids uuid[]
WITH target AS (
    SELECT o.event_id,
           o.dead_at IS NOT NULL AND o.published_at IS NULL AS dead,
           o.published_at IS NOT NULL AS published,
           o.discarded_at IS NOT NULL AS discarded,
           CASE
               WHEN NOT (substr(o.event_id::text, 15, 1) = '7'
                         AND substr(o.event_id::text, 20, 1) IN ('8', '9', 'a', 'b'))
                   THEN 'event_id is not a UUIDv7 (check relayd_event_id_is_uuidv7)'
               WHEN jsonb_typeof(o.job) <> 'object'
                   THEN 'the job is not a JSON object (check relayd_job_is_object)'
               WHEN jsonb_typeof(o.job -> 'args') IS DISTINCT FROM 'array'
                   THEN 'args is not an array (check relayd_job_args_is_array)'
               WHEN jsonb_typeof(o.job -> 'type') IS DISTINCT FROM 'string'
                   THEN 'type is not a string (check relayd_job_type_is_string)'
               WHEN coalesce(jsonb_typeof(o.job -> 'meta'), 'object') <> 'object'
                   THEN 'meta is not an object (check relayd_job_meta_is_object)'
               WHEN NOT isfinite(o.created_at)
                   THEN 'created_at is not a finite time (check relayd_created_at_is_finite)'
           END AS refusal
    FROM @outbox@ AS o
    WHERE o.event_id = ANY($1::uuid[])
    FOR UPDATE
),
redriven AS (
    UPDATE @outbox@ AS o
    SET dead_at = NULL,
        dead_reason = NULL,
        attempts = 0,
        -- clock_timestamp(), not now(): the row locks of `target` gave this transaction
        -- its id, so it shows as a writer before the rows are due and they never land
        -- below a claim's watermark (what relayd_available_at() does for a new row; the
        -- operator commands do not require the migration that made it).
        available_at = clock_timestamp(),
        -- Later than last_attempt_at (stamped by the claim before the row was dead-lettered);
        -- a claim that takes the row starts once this has committed, so its now() is later.
        redriven_at = clock_timestamp(),
        lease_owner = NULL,
        discarded_at = NULL,
        discard_reason = NULL
    FROM target AS t
    WHERE o.event_id = t.event_id AND t.dead AND t.refusal IS NULL
    RETURNING o.event_id
)
SELECT t.event_id::text AS event_id, t.dead, t.published, t.discarded, t.refusal,
       r.event_id IS NOT NULL AS changed
FROM target AS t
LEFT JOIN redriven AS r ON r.event_id = t.event_id;

-- name: dlq_discard
-- Mark dead letters as discarded: kept in the table (C7), out of the dead-letter queue and
-- its index. A row discarded already keeps its first discard.
-- params: $1 event ids uuid[], $2 reason text
WITH target AS (
    SELECT event_id,
           dead_at IS NOT NULL AND published_at IS NULL AS dead,
           published_at IS NOT NULL AS published,
           discarded_at IS NOT NULL AS discarded
    FROM @outbox@
    WHERE event_id = ANY($1::uuid[])
    FOR UPDATE
),
discarded AS (
    UPDATE @outbox@ AS o
    SET discarded_at = now(),
        discard_reason = $2
    FROM target AS t
    WHERE o.event_id = t.event_id AND t.dead AND NOT t.discarded
    RETURNING o.event_id
)
SELECT t.event_id::text AS event_id, t.dead, t.published, t.discarded, NULL::text AS refusal,
       d.event_id IS NOT NULL AS changed
FROM target AS t
LEFT JOIN discarded AS d ON d.event_id = t.event_id;

-- name: audit_insert
-- One row per mutating operator action, written in the transaction of its first change.
-- params: $1 outbox table text, $2 actor text, $3 action text, $4 filters jsonb (as text),
--         $5 event ids uuid[]|null, $6 row count int, $7 reason text|null
INSERT INTO @schema@.relayd_audit (outbox_table, actor, action, filters, event_ids, row_count,
                                   reason)
VALUES ($1, $2, $3, $4::jsonb, $5::uuid[], $6, $7)
RETURNING id;

-- name: audit_note
-- One operator action that changes no row (a pause, a resume), in its own transaction. No
-- RETURNING: the poison-storm guard pauses through it, and relayd's role needs no SELECT on
-- the audit trail.
-- params: $1 outbox table text, $2 actor text, $3 action text, $4 filters jsonb (as text),
--         $5 reason text|null
INSERT INTO @schema@.relayd_audit (outbox_table, actor, action, filters, row_count, reason)
VALUES ($1, $2, $3, $4::jsonb, 1, $5);

-- name: audit_extend
-- A later batch of the same action adds its rows to the action's audit row, in the batch's
-- own transaction: the audit row always counts exactly what was committed. The ids are kept
-- while they number at most $4; past that, only the count.
-- params: $1 audit id bigint, $2 row count int, $3 event ids uuid[], $4 most ids kept int
UPDATE @schema@.relayd_audit
SET row_count = row_count + $2,
    event_ids = CASE
                    WHEN event_ids IS NOT NULL
                         AND cardinality(event_ids) + cardinality($3::uuid[]) <= $4
                        THEN event_ids || $3::uuid[]
                END
WHERE id = $1;

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

-- ============================================================================================
-- The outbox's health in the database: `relayd check`, `relayd doctor`.
-- ============================================================================================

-- name: check_identity
-- Who and where we are, for `relayd check`: never the DSN (it may hold a password).
-- params: none
SELECT current_user::text AS username,
       current_database()::text AS database,
       current_setting('server_version') AS server_version,
       pg_is_in_recovery() AS in_recovery,
       extract(epoch FROM clock_timestamp())::float8 AS epoch_s;

-- name: check_ledger_exists
-- Whether the migration ledger exists (an outbox made by hand has none).
-- params: $1 the ledger's qualified name text
SELECT to_regclass($1) IS NOT NULL;

-- name: check_privileges
-- For each wanted (kind, schema, name, privilege), in order, whether the current user holds
-- it (itself, through a role it is a member of, or through PUBLIC); NULL when there is no
-- such object. Objects are found in the catalogs by name and checked by oid: a name cast
-- from text fails, instead of answering, without USAGE on its schema.
-- params: $1 kinds text[] (database, schema, table, sequence, function), $2 schemas text[],
--         $3 names text[], $4 privileges text[]
SELECT CASE w.kind
           WHEN 'database' THEN has_database_privilege(current_database(), w.privilege)
           WHEN 'schema' THEN (
               SELECT has_schema_privilege(n.oid, w.privilege)
               FROM pg_namespace AS n
               WHERE n.nspname = w.schema_name)
           WHEN 'table' THEN (
               SELECT has_table_privilege(c.oid, w.privilege)
               FROM pg_class AS c
               JOIN pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = w.schema_name AND c.relname = w.name
                 AND c.relkind IN ('r', 'p'))
           WHEN 'sequence' THEN (
               SELECT has_sequence_privilege(c.oid, w.privilege)
               FROM pg_class AS c
               JOIN pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = w.schema_name AND c.relname = w.name AND c.relkind = 'S')
           WHEN 'function' THEN (
               SELECT bool_and(has_function_privilege(p.oid, w.privilege))
               FROM pg_proc AS p
               JOIN pg_namespace AS n ON n.oid = p.pronamespace
               WHERE n.nspname = w.schema_name AND p.proname = w.name)
       END AS held
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY
     AS w(kind, schema_name, name, privilege, position)
ORDER BY w.position;

-- name: check_sees_writers
-- Whether this role sees when other roles' transactions started (superuser, or a member of
-- pg_read_all_stats): without it the claim's watermark is unknown and every claim reads the
-- whole claim index.
-- params: none
SELECT coalesce((SELECT rolsuper FROM pg_roles WHERE rolname = current_user), false)
       OR pg_has_role(current_user, 'pg_read_all_stats', 'USAGE');

-- name: doctor_table
-- The outbox table's vacuum statistics and size.
-- params: $1 schema text, $2 table text
SELECT n_live_tup, n_dead_tup, last_vacuum, last_autovacuum, last_analyze, last_autoanalyze,
       autovacuum_count,
       pg_relation_size(relid) AS table_bytes,
       pg_total_relation_size(relid) AS total_bytes
FROM pg_stat_user_tables
WHERE schemaname = $1 AND relname = $2;

-- name: doctor_indexes
-- The outbox's indexes: size and how often each was scanned.
-- params: $1 schema text, $2 table text
SELECT indexrelname::text AS name, pg_relation_size(indexrelid) AS bytes, idx_scan
FROM pg_stat_user_indexes
WHERE schemaname = $1 AND relname = $2
ORDER BY indexrelname;

-- name: plan_as_relay
-- For the rest of this transaction, plan as `relayd run`'s sessions do: they price
-- sequential scans out (store/connection.py, _server_settings), so `relayd doctor` explains
-- the claim plan a relay gets, not the one a default session would.
-- params: none
SELECT set_config('enable_seqscan', 'off', true);

-- name: doctor_xmin_holders
-- The sessions holding back the xmin horizon (so vacuum cannot remove dead rows), oldest
-- first: a long report, a forgotten BEGIN. Never their query text: it may hold secrets.
-- params: $1 limit int
SELECT pid, usename::text AS username, application_name, client_addr::text AS client,
       state, datname::text AS database,
       extract(epoch FROM clock_timestamp() - xact_start)::float8 AS xact_age_s,
       age(backend_xmin)::bigint AS xmin_age_xids
FROM pg_stat_activity
WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
ORDER BY age(backend_xmin) DESC
LIMIT $1;

-- name: doctor_horizon_others
-- Other holders of the horizon: replication slots, standbys with hot_standby_feedback, and
-- prepared transactions. kind, name, xmin age in transactions.
-- params: none
SELECT 'replication slot' AS kind, slot_name::text AS name,
       greatest(age(xmin), age(catalog_xmin))::bigint AS xmin_age_xids
FROM pg_replication_slots
WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
UNION ALL
SELECT 'standby feedback', coalesce(application_name, client_addr::text, ''),
       age(backend_xmin)::bigint
FROM pg_stat_replication
WHERE backend_xmin IS NOT NULL
UNION ALL
SELECT 'prepared transaction', gid, age(transaction)::bigint
FROM pg_prepared_xacts
ORDER BY 3 DESC;


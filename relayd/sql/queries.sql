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

-- ============================================================================================
-- Dead letters, pauses and the audit trail: `relayd dlq`, `relayd pause`, `relayd resume`,
-- and the poison-storm guard's pause.
-- ============================================================================================

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
-- For each (relation, privilege) pair, whether the current user holds it.
-- params: $1 relations text[], $2 privileges text[]
SELECT r.relation, r.privilege, has_table_privilege(r.relation, r.privilege) AS held
FROM unnest($1::text[], $2::text[]) AS r(relation, privilege);

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


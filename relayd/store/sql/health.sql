-- The outbox's health in the database: `relayd check`, `relayd doctor`
-- (relayd/store/health.py).
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

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

-- 0004_watermark: what lets a claim start at its watermark instead of the start of the claim
-- index (relayd/watermark.py, docs/performance.md), and vacuum settings for a table whose
-- every row is updated twice.
--
-- A new row becomes due at the moment it is inserted, not at its transaction's start: a
-- producer transaction that began long ago (a slow request, a batch job) and commits now
-- must not land below the watermark of the relays that claimed rows committed meanwhile.
-- clock_timestamp() is the statement's time; relayd bounds the rows of transactions still
-- open by their start in pg_stat_activity, which is earlier still. Existing rows keep their
-- values; only the default changes (no rewrite, no long lock).
ALTER TABLE @outbox@ ALTER COLUMN available_at SET DEFAULT clock_timestamp();

-- Every row is inserted, claimed (updated) and published (updated): two dead tuples per row
-- published. The default thresholds (20 % of the table) let a large outbox pile up millions
-- of them before autovacuum starts; 1 % (and every 10,000 rows) keeps the indexes the claim
-- reads small. The insert thresholds make autovacuum mark new pages all-visible early, which
-- keeps the backlog sampler's index-only scans from visiting the table.
ALTER TABLE @outbox@ SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02
);

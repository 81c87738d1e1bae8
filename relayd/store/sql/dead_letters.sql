-- Dead letters and the audit trail: `relayd dlq` (relayd/store/dead_letters.py).
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

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
-- names); store/dead_letters.py falls back to one row at a time if a check this list does not know
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
        -- A row of an ordered key goes back to 'infinity', where the ordered claim finds a
        -- key's head (migration 0011): it is sent in its key's order, before the key's
        -- rows still pending, and not while its key is parked or has a row in flight.
        available_at = CASE WHEN o.ordering_key IS NULL THEN clock_timestamp()
                            ELSE 'infinity' END,
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

-- name: dlq_out_of_order
-- The dead letters of ordered keys that later rows of their key overtook: rows of the same
-- key, numbered after them, that were published. Redriving one would deliver it after them,
-- which `relayd dlq retry` refuses unless --out-of-order. $3 names the rows (the named ids,
-- or one batch's); NULL selects what a bulk walk would, with the dead_letter_filters:
-- dead letters not discarded, dead-lettered from $1 until before $2.
-- A later row can only have been published after the dead one stopped being pending: at
-- the latest after its created_at, or its dead_at if a producer's created_at lies ahead. So
-- the published rows are read from the earliest such time of the rows selected on (through
-- the index on published_at, when the planner finds it cheaper), and only when a row
-- selected is ordered. Published rows that retention cleanup deleted are not counted.
-- params: $1 since timestamptz|null, $2 until timestamptz|null, $3 event ids uuid[]|null,
--         $4 most rows returned int, then the dead_letter_filters
WITH target AS (
    SELECT o.event_id, o.ordering_key, o.ordering_seq,
           least(o.created_at, o.dead_at) AS since
    FROM @outbox@ AS o
    WHERE o.dead_at IS NOT NULL AND o.published_at IS NULL AND o.ordering_key IS NOT NULL
      AND ($3::uuid[] IS NOT NULL
           OR (o.discarded_at IS NULL
               AND o.dead_at >= coalesce($1::timestamptz, '-infinity')
               AND o.dead_at < coalesce($2::timestamptz, 'infinity')))
      AND ($3::uuid[] IS NULL OR o.event_id = ANY($3::uuid[]))
      AND @dead_letter_filters@
),
later AS (
    -- EXISTS is evaluated once, before the scan: with no ordered dead letter selected (the
    -- usual batch) the published rows are not read at all, whatever plan the scan has.
    SELECT o.ordering_key, o.ordering_seq
    FROM @outbox@ AS o
    WHERE EXISTS (SELECT 1 FROM target)
      AND o.published_at >= (SELECT min(since) FROM target)
      AND o.ordering_key IN (SELECT ordering_key FROM target)
)
SELECT t.event_id::text AS event_id, t.ordering_key, count(*) AS delivered_after,
       count(*) OVER () AS offenders
FROM target AS t
JOIN later AS l ON l.ordering_key = t.ordering_key AND l.ordering_seq > t.ordering_seq
GROUP BY t.event_id, t.ordering_key
ORDER BY t.event_id
LIMIT $4;

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
-- One row per mutating operator action, written in the transaction of its first change,
-- with one row per row it changed (relayd_audit_rows, every id; relayd_audit lists at most
-- $8 of them).
-- params: $1 outbox table text, $2 actor text, $3 action text, $4 filters jsonb (as text),
--         $5 event ids uuid[], $6 row count int, $7 reason text|null, $8 most ids listed int
WITH action AS (
    INSERT INTO @schema@.relayd_audit (outbox_table, actor, action, filters, event_ids,
                                       row_count, reason)
    VALUES ($1, $2, $3, $4::jsonb,
            CASE WHEN cardinality($5::uuid[]) <= $8 THEN $5::uuid[] END, $6, $7)
    RETURNING id
), named AS (
    INSERT INTO @schema@.relayd_audit_rows (event_id, audit_id)
    SELECT DISTINCT listed.event_id, action.id
    FROM action CROSS JOIN unnest($5::uuid[]) AS listed (event_id)
)
SELECT id FROM action;

-- name: audit_extend
-- A later batch of the same action adds its rows to the action's audit row, in the batch's
-- own transaction: the audit row always counts exactly what was committed, and each row is
-- named in relayd_audit_rows. The audit row's list keeps the ids while they number at most
-- $4; past that, only the count.
-- params: $1 audit id bigint, $2 row count int, $3 event ids uuid[], $4 most ids kept int
WITH named AS (
    INSERT INTO @schema@.relayd_audit_rows (event_id, audit_id)
    SELECT DISTINCT listed.event_id, $1::bigint
    FROM unnest($3::uuid[]) AS listed (event_id)
    ON CONFLICT DO NOTHING
)
UPDATE @schema@.relayd_audit
SET row_count = row_count + $2,
    event_ids = CASE
                    WHEN event_ids IS NOT NULL
                         AND cardinality(event_ids) + cardinality($3::uuid[]) <= $4
                        THEN event_ids || $3::uuid[]
                END
WHERE id = $1;

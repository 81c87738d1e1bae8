-- The relay's cycle: claim, the settles, the next due row, retention (relayd/store/cycle.py).
-- One named block per statement, run by the method of the same name. @outbox@, @schema@
-- and @name@ are replaced once at start-up by the validated, quoted identifiers;
-- asyncpg binds by position: each block lists its parameters.

-- fragment: claim_marks
-- What a claim's answer carries for the next watermark (`claim`, `claim_ordered`; $5 the
-- scan's start), when the worker asks for it ($6: the marks cost a read of every server
-- process's slot in pg_stat_activity, which a worker claiming a row at a time need not pay
-- on every claim; NULL both when not asked, relayd/engine/watermark.py). Finite values
-- only: a row parked at 'infinity' bounds nothing, and one at '-infinity' is claimed by
-- the next full scan. writers_since is NULL when a writer's start is hidden from us
-- (another role's session, without pg_read_all_stats): nothing is known, and the next
-- claim reads the whole index.
SELECT CASE WHEN $6::bool THEN
           (SELECT min(available_at) FROM @outbox@
            WHERE published_at IS NULL AND dead_at IS NULL
              AND available_at >= coalesce($5::timestamptz, '-infinity')
              AND available_at > '-infinity' AND available_at < 'infinity') END AS head,
       CASE WHEN $6::bool THEN
           (SELECT CASE WHEN bool_or(xact_start IS NULL) THEN NULL
                        ELSE coalesce(min(xact_start), now()) END
            FROM pg_stat_activity
            WHERE backend_xid IS NOT NULL AND datname = current_database()
              AND pid <> pg_backend_pid()) END AS writers_since

-- fragment: claim_keyed
-- Whether any row of an ordered key is pending (`claim`, `claim_ordered`): one probe of the
-- keys' index. While none is, the worker runs `claim`, about a fifth cheaper for one row.
SELECT EXISTS (
    SELECT 1 FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL)

-- fragment: claim_next_due
-- Seconds from the claim's start until the first pending row it did not take is due
-- (`claim`, `claim_ordered`: the rows of its `claimed` part are left out; negative: one is
-- due now but was locked by another claimer), NULL when there is none: what `next_due_s`
-- would answer once the claim's rows are settled, so that a worker whose claim came back
-- short sleeps without asking. The same scan and pause checks as `next_due_s`.
SELECT (extract(epoch FROM available_at) - extract(epoch FROM now()))::float8
FROM @outbox@
WHERE published_at IS NULL AND dead_at IS NULL
  AND available_at >= coalesce($5::timestamptz, '-infinity')
  AND event_id::text NOT IN (SELECT event_id FROM claimed)
  AND @claim_not_paused@
ORDER BY available_at, event_id
LIMIT 1

-- fragment: claim_not_paused
-- A row no pause holds (`claim`, `claim_ordered`; $4 the outbox table): the pause checks
-- described at `claim`, uncorrelated subqueries evaluated once per statement.
NOT EXISTS (
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
--         $5 scan from timestamptz (NULL: the whole index), $6 the watermark's marks bool
WITH durable AS (
    SELECT CASE WHEN current_setting('synchronous_commit') = 'off'
                THEN set_config('synchronous_commit', 'on', true) END
),
marks AS @claim_marks@,
due AS (
    SELECT event_id, last_attempt_at, redriven_at
    FROM @outbox@
    WHERE published_at IS NULL AND dead_at IS NULL
      AND available_at >= coalesce($5::timestamptz, '-infinity') AND available_at <= now()
      AND @claim_not_paused@
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
SELECT claimed.*, NULL::timestamptz AS head, NULL::timestamptz AS writers_since,
       NULL::float8 AS next_due_s, NULL::bool AS keyed
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, marks.head, marks.writers_since, @claim_next_due@,
       @claim_keyed@
FROM marks, durable;

-- name: claim_ordered
-- The claim of an outbox with ordered rows (docs/ordering.md): the unordered rows exactly as
-- `claim` takes them, and beside them the heads of keys. A keyed row is written with
-- available_at 'infinity' (migration 0011), out of the unordered range; a key's head is its
-- pending row with the lowest ordering_seq, which is a candidate while it has never been
-- claimed (available_at still 'infinity') and its key is not parked. Once claimed, a head
-- holds its lease and backoff in available_at as any row does, and the unordered part
-- takes it again when it is due: it is still its key's head, since only a publish or a
-- dead letter ends a head. So at most one row of a key is ever leased, and a key's next row
-- is a candidate only once every earlier one is published or dead-lettered.
--
-- `walk` visits keys in key order, from $7 (exclusive; NULL: the first), one index probe
-- each: the head of the next key is the first entry after the previous key, whatever the
-- number of rows behind it, so a hot key costs what a quiet one does and yields one row per
-- claim. The walk stops as soon as $1 candidates are found. The marks row carries the last
-- candidate's key (`walked_to`): the worker starts its next walk there, so the keys are
-- served in turn; NULL when the walk reached the last key, to start again from the first.
-- The two parts are interleaved (one of each in turn) up to $1 rows in all.
-- params: $1 limit int, $2 owner token uuid, $3 lease_s float8, $4 outbox table text,
--         $5 scan from timestamptz (NULL: the whole index), $6 the watermark's marks bool,
--         $7 walk from text (NULL: first)
WITH RECURSIVE durable AS (
    SELECT CASE WHEN current_setting('synchronous_commit') = 'off'
                THEN set_config('synchronous_commit', 'on', true) END
),
marks AS @claim_marks@,
walk AS (
    (SELECT ordering_key, event_id, available_at
     FROM @outbox@
     WHERE published_at IS NULL AND dead_at IS NULL
       AND ordering_key > coalesce($7::text, '')
     ORDER BY ordering_key, ordering_seq
     LIMIT 1)
    UNION ALL
    SELECT step.ordering_key, step.event_id, step.available_at
    FROM walk
    CROSS JOIN LATERAL (
        SELECT o.ordering_key, o.event_id, o.available_at
        FROM @outbox@ AS o
        WHERE o.published_at IS NULL AND o.dead_at IS NULL
          AND o.ordering_key > walk.ordering_key
        ORDER BY o.ordering_key, o.ordering_seq
        LIMIT 1
    ) AS step
),
heads AS (
    -- Each candidate locked as the walk meets it, a head another claim holds skipped, until
    -- $1 are locked: LIMIT above the locking, so that concurrent claims walking the same keys
    -- pass each other's heads instead of coming back short. The outbox is read through its
    -- primary key, one row per key walked.
    SELECT o.event_id, o.last_attempt_at, o.redriven_at, o.ordering_key
    FROM walk
    CROSS JOIN LATERAL (
        SELECT * FROM @outbox@ AS h WHERE h.event_id = walk.event_id
    ) AS o
    WHERE walk.available_at = 'infinity'
      AND o.published_at IS NULL AND o.dead_at IS NULL AND o.available_at = 'infinity'
      AND NOT EXISTS (
          SELECT 1 FROM @schema@.relayd_parked_keys AS p
          WHERE p.outbox_table = $4 AND p.destination = ''
            AND p.ordering_key = walk.ordering_key)
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
),
ordered_due AS (
    SELECT event_id, last_attempt_at, redriven_at,
           row_number() OVER (ORDER BY ordering_key) AS turn
    FROM heads
),
due AS (
    SELECT event_id, last_attempt_at, redriven_at,
           row_number() OVER (ORDER BY available_at, event_id) AS turn
    FROM (
        SELECT event_id, last_attempt_at, redriven_at, available_at
        FROM @outbox@
        WHERE published_at IS NULL AND dead_at IS NULL
          AND available_at >= coalesce($5::timestamptz, '-infinity') AND available_at <= now()
          AND @claim_not_paused@
        ORDER BY available_at, event_id
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    ) AS locked
),
chosen AS (
    SELECT event_id, last_attempt_at, redriven_at
    FROM (SELECT *, 0 AS part FROM due UNION ALL SELECT *, 1 AS part FROM ordered_due) AS both_parts
    ORDER BY turn, part
    LIMIT $1
),
claimed AS (
    UPDATE @outbox@ AS o
    SET lease_owner = $2,
        available_at = now() + make_interval(secs => $3),
        attempts = o.attempts + 1,
        last_attempt_at = now()
    FROM chosen
    WHERE o.event_id = chosen.event_id
    RETURNING o.event_id::text AS event_id,
              convert_to(o.job::text, 'UTF8') AS job,
              o.attempts,
              chosen.last_attempt_at AS previous_attempt_at,
              (extract(epoch FROM clock_timestamp()) - extract(epoch FROM o.created_at))::float8
                  AS age_s,
              chosen.redriven_at IS NOT NULL
                  AND chosen.redriven_at > coalesce(chosen.last_attempt_at, '-infinity')
                  AS redriven,
              o.ordering_key
)
SELECT claimed.*, NULL::timestamptz AS head, NULL::timestamptz AS writers_since,
       NULL::text AS walked_to, NULL::float8 AS next_due_s, NULL::bool AS keyed
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, marks.head, marks.writers_since,
       (SELECT CASE WHEN count(*) < $1 THEN NULL ELSE max(ordering_key) END FROM heads),
       @claim_next_due@, @claim_keyed@
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
-- due before this statement shows as a writer could fall below a watermark. A row whose
-- attempt sent nothing (refused before any byte left: not connected) gets its previous
-- attempt time back, as a release does: the next claim must not take it for a row an
-- earlier attempt may have delivered.
-- params: $1 owner token uuid, $2 event ids uuid[], $3 delays float8[] (seconds),
--         $4 errors text[], $5 refunds int[] (0 or 1), $6 sent bool[],
--         $7 previous attempt times timestamptz[] (restored where not sent)
-- Returns NULL when every row was still this owner's (the usual case: nothing to decode),
-- else the ids it did update.
WITH lazy AS @lazy_commit@,
settled AS (
    UPDATE @outbox@ AS o
    SET lease_owner = NULL,
        available_at = @schema@.relayd_available_at() + make_interval(secs => r.delay_s),
        last_error = r.error,
        attempts = greatest(o.attempts - r.refund, 0),
        last_attempt_at = CASE WHEN r.sent THEN o.last_attempt_at ELSE r.previous_attempt_at END
    FROM unnest($2::uuid[], $3::float8[], $4::text[], $5::int[], $6::bool[], $7::timestamptz[])
        AS r(event_id, delay_s, error, refund, sent, previous_attempt_at)
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

-- name: settle_parked
-- A head of an ordered key that exhausted its attempts or was refused for good, on a route
-- that parks (docs/ordering.md): the row stays pending, keeps its attempts and waits at
-- available_at 'infinity' (where the ordered claim looks for heads), and its key is parked,
-- so the key's later rows wait too, until an operator retries, skips or releases it
-- (`relayd keys`). A key already parked stays as it was. Fenced. Lazy commit.
-- params: $1 owner token uuid, $2 event ids uuid[], $3 reasons text[], $4 errors text[],
--         $5 outbox table text
-- Returns NULL when every row was still this owner's, else the ids it did update.
WITH lazy AS @lazy_commit@,
settled AS (
    UPDATE @outbox@ AS o
    SET lease_owner = NULL,
        available_at = 'infinity',
        last_error = r.error
    FROM unnest($2::uuid[], $3::text[], $4::text[]) AS r(event_id, reason, error)
    WHERE o.event_id = r.event_id AND o.lease_owner = $1 AND o.ordering_key IS NOT NULL
    RETURNING o.event_id, o.ordering_key, coalesce(o.job ->> 'type', '') AS type, r.reason,
              r.error
),
parked AS (
    INSERT INTO @schema@.relayd_parked_keys
        (outbox_table, ordering_key, event_id, type, reason, error)
    SELECT $5, ordering_key, event_id, type, reason, error FROM settled
    ON CONFLICT DO NOTHING
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

-- name: take_back
-- At start-up, the leases of a dead process of this relay's identity (its proof of life:
-- relayd/engine/liveness.py), whose owner tokens lie from $1 to $2: due at once, for any
-- replica, without waiting out relay.lease_s. Each keeps the attempt its claim counted and
-- its last_attempt_at, so it is reconciled (or read back) before it is sent again: the dead
-- process may have sent it. Only leases still running are taken (their available_at lies
-- ahead), through the claim index. Due from relayd_available_at(), as a new row is.
-- params: $1 lowest owner token uuid, $2 highest owner token uuid
WITH taken AS (
    UPDATE @outbox@
    SET lease_owner = NULL,
        available_at = @schema@.relayd_available_at()
    WHERE published_at IS NULL AND dead_at IS NULL
      AND available_at > now()
      AND lease_owner BETWEEN $1 AND $2
    RETURNING 1
)
SELECT count(*) FROM taken;

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

-- name: ping
-- Readiness: the database answers.
-- params: none
SELECT 1;

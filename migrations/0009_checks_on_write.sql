-- 0009_checks_on_write: the outbox's rules are checked when a row is written (inserted, or
-- its id, job or creation time changed) or made pending again, no longer on every UPDATE
-- relayd makes to lease a row and to settle it.
--
-- Why: PostgreSQL evaluates every CHECK constraint on every UPDATE of a row, whichever
-- columns it sets. The claim and the settles never set what the rules read (the id, the
-- job, the creation time), yet each paid for relayd_check_row: about a fifth of the server
-- CPU a claim and a settle cost per row (docs/performance.md). A trigger names the columns
-- it watches (`UPDATE OF`), and a WHEN clause is tried without calling the function.
--
-- The rules, their names and their outcome are the same (relayd_check_row, 0008): a row is
-- refused with SQLSTATE 23514 (check_violation), the refused rule's name as the error's
-- constraint name and in its message. What checks what:
-- - trigger relayd_row_checks, BEFORE INSERT OR UPDATE OF event_id, job, created_at: every
--   rule (producers' inserts, COPY, an operator's edit of a job);
-- - trigger relayd_row_checks_pending_again, BEFORE UPDATE OF published_at, dead_at, for a
--   row that was published or dead-lettered and is neither any more (a redrive): every rule,
--   since those states exempted it from some;
-- - CHECK relayd_attempts_not_negative: the one rule relayd's own updates could break (the
--   claim counts attempts up, a refund counts them down).
-- Setting published_at or dead_at only exempts a row from rules: nothing to check then.
--
-- Triggers do not fire where session_replication_role is `replica` (a logical replication
-- worker applying rows): those rows were checked where they were first written.
--
-- NOT VALID, as in 0008: every existing row passed these rules moments ago.

CREATE OR REPLACE FUNCTION @schema@.relayd_check_written_row() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    passed boolean;
BEGIN
    -- True, or an exception naming the rule the row breaks. An assignment, not PERFORM:
    -- PL/pgSQL evaluates it as a simple expression, without a query of its own.
    passed := @schema@.relayd_check_row(NEW.event_id, NEW.job, NEW.attempts, NEW.created_at,
                                        NEW.published_at, NEW.dead_at);
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS relayd_row_checks ON @outbox@;
CREATE TRIGGER relayd_row_checks
    BEFORE INSERT OR UPDATE OF event_id, job, created_at ON @outbox@
    FOR EACH ROW EXECUTE FUNCTION @schema@.relayd_check_written_row();

DROP TRIGGER IF EXISTS relayd_row_checks_pending_again ON @outbox@;
CREATE TRIGGER relayd_row_checks_pending_again
    BEFORE UPDATE OF published_at, dead_at ON @outbox@
    FOR EACH ROW
    WHEN (NEW.published_at IS NULL AND NEW.dead_at IS NULL
          AND (OLD.published_at IS NOT NULL OR OLD.dead_at IS NOT NULL))
    EXECUTE FUNCTION @schema@.relayd_check_written_row();

ALTER TABLE @outbox@
    DROP CONSTRAINT IF EXISTS relayd_row_checks,
    DROP CONSTRAINT IF EXISTS relayd_attempts_not_negative,
    ADD CONSTRAINT relayd_attempts_not_negative CHECK (attempts >= 0) NOT VALID;

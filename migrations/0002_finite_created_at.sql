-- 0002_finite_created_at: refuse an infinite created_at.
--
-- created_at is the producer's column (its commit-time proxy) and feeds the lag metrics.
-- 'infinity' and '-infinity' are valid timestamptz values that no lag can be computed from;
-- a pending row holding one used to fail every claim. The claim is now immune to them, and
-- this check refuses them at INSERT, inside the producer's transaction, naming the rule.
--
-- On an adopted table, pending rows that already hold one are dead-lettered first (kept,
-- visible to operators), as 0001 does with envelopes that fail its checks. Published and
-- dead rows are exempt: they will never be claimed again.

UPDATE @outbox@
SET dead_at = now(),
    dead_reason = 'invalid_envelope',
    last_error = 'dead-lettered by relayd migrate: created_at is not a finite time',
    lease_owner = NULL
WHERE published_at IS NULL
  AND dead_at IS NULL
  AND NOT isfinite(created_at);

ALTER TABLE @outbox@
    ADD CONSTRAINT relayd_created_at_is_finite
        CHECK (published_at IS NOT NULL OR dead_at IS NOT NULL OR isfinite(created_at));

-- 0012_audit_rows: one audit row per row an operator acted on.
--
-- - relayd_audit_rows: each row a mutating action changed (a redrive, a discard, a key's
--   retry, skip or release), with the action's audit row it belongs to. relayd_audit keeps
--   one row per action (who, what, the filters, the count, the reason) and lists at most 100
--   ids of a bulk action; here every row of every action is named, whatever its size, in the
--   transaction that changed it, so an event's history (`relayd console`'s timeline) finds
--   each action on it by its id.
-- - The primary key leads with the event id: an event's actions are one index range.
-- - The ids the audit trail already lists are copied here.
--
-- Shared by every outbox of the schema, as relayd_audit is: the step runs again, harmlessly,
-- when a second outbox of the same schema is migrated.

CREATE TABLE IF NOT EXISTS @schema@.relayd_audit_rows (
    event_id uuid   NOT NULL,
    audit_id bigint NOT NULL REFERENCES @schema@.relayd_audit (id) ON DELETE CASCADE,
    PRIMARY KEY (event_id, audit_id)
);

INSERT INTO @schema@.relayd_audit_rows (event_id, audit_id)
SELECT DISTINCT listed.event_id, a.id
FROM @schema@.relayd_audit AS a
CROSS JOIN LATERAL unnest(a.event_ids) AS listed (event_id)
WHERE a.event_ids IS NOT NULL
ON CONFLICT DO NOTHING;

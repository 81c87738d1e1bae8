-- 0010_breaker_reason: why a relay's circuit breaker is open, on its heartbeat.
--
-- - relayd_instances.breaker_reason: the sink's failure that opened the relay's breaker last
--   (the first one of an outage, or a failed probe's), in relayd's words and with the host
--   and port where it is a connection's failure; NULL while the breaker is closed.
--   `relayd status` and `/v1/status` show it beside the breaker's state, on every host.
--
-- relayd_instances serves every outbox of the schema: the step runs again, harmlessly, when
-- a second outbox of the same schema is migrated. Nullable and without a default: adding it
-- rewrites no row.

ALTER TABLE @schema@.relayd_instances ADD COLUMN IF NOT EXISTS breaker_reason text;

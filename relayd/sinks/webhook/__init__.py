"""The Standard Webhooks destination (`[sink] kind = "webhook"`): each event is a signed POST
to its endpoint, re-sent with the same `webhook-id` after an unanswered attempt, for the
receiver to deduplicate (docs/webhooks.md)."""

"""The NATS JetStream destination (`[sink] kind = "nats"`, the `relayd[nats]` extra): each
event is a message on its route's subject, its id the message id JetStream deduplicates on,
in the dedupe mode its route allows (docs/nats.md)."""

"""Values and pure rules, no I/O: the outbox's rows and envelopes, the outcomes of an attempt,
backoff and the circuit breaker's rules, the backlog's counting, JSON values, trace context,
how idle loops wait, and relayd's errors. Every other part of relayd stands on these."""

__version__ = "0.1.0"

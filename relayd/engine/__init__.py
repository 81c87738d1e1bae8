"""The engine room: a relay worker's claim -> publish -> settle (`relay.py`, `settle.py`),
and what the workers of one process share: the claim's bounds and owner tokens
(`claim.py`), each attempt's deadline, the circuit breaker's gate, the poison-storm guard,
the claim's watermark, the housekeeping chores, and the process's proof of life
(`liveness.py`). It knows a destination only through the seam in `relayd/sinks/`."""

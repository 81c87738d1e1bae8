"""What relayd tells the outside: every Prometheus metric (`metrics.py`), structured logs
(`logs.py`) and the relay's OpenTelemetry spans (`tracing.py`)."""

"""The process around the engine: its lifecycle (startup, serve, drain, shutdown), the
backlog sampler and heartbeat, retention cleanup, the LISTEN wakeup, systemd's
notifications and the HTTP endpoints (`/metrics`, `/healthz`, `/readyz`, `/v1/status`)."""

"""relayd's settings in every scenario, in one place: the RELAYD_* environment each `relayd
run` of a scenario gets (plus RELAYD_OUTBOX__TABLE, the scenario's own table, and what
`relay_process` sets: the database, the sink, the metrics port, JSON logs).

Everything not named here is relayd's default (config.example.toml), on purpose: the
benchmarks measure relayd as an operator would run it. Logging is at warning so that a
per-row debug or info line does not turn the benchmark into a logging benchmark.
"""

from __future__ import annotations

from types import MappingProxyType

COMMON: MappingProxyType[str, str] = MappingProxyType({"RELAYD_LOG__LEVEL": "warning"})

# Keyed by "<scenario>" or "<scenario>.<mode>"; see relay_settings().
RELAYD: MappingProxyType[str, MappingProxyType[str, str]] = MappingProxyType(
    {
        # drain: the same relayd, one row per POST or up to sink.batch_max_jobs per POST.
        "drain.per_row": MappingProxyType({"RELAYD_SINK__BATCH": "off"}),
        "drain.batch": MappingProxyType({"RELAYD_SINK__BATCH": "on"}),
        # The other scenarios run batch mode with every other setting at its default
        # (`auto` would also pick batches, since the emulator advertises them; `on` says so).
        "lag": MappingProxyType({"RELAYD_SINK__BATCH": "on"}),
        "horizon": MappingProxyType({"RELAYD_SINK__BATCH": "on"}),
        "memory": MappingProxyType({"RELAYD_SINK__BATCH": "on"}),
        "replicas": MappingProxyType({"RELAYD_SINK__BATCH": "on"}),
        # ordered: batch mode, without and with `[sink] ordering = "key"`.
        "ordered.unordered": MappingProxyType({"RELAYD_SINK__BATCH": "on"}),
        "ordered.keyed": MappingProxyType(
            {"RELAYD_SINK__BATCH": "on", "RELAYD_SINK__ORDERING": "key"}
        ),
        # nats: the NATS sink at its defaults (bench/nats.py gives the server, the stream
        # and the routes, as RELAYD_SINK__* variables).
        "nats": MappingProxyType({}),
        # webhook: the webhook sink at its defaults (bench/webhook.py gives the kind, the
        # receiver's URL and the secret file, as RELAYD_SINK__* variables).
        "webhook": MappingProxyType({}),
        # tracing: batch mode without, then with, the relay's spans, through the standard OTEL_*
        # variables (the SDK, the always-on sampler, no exporter: recorded, never exported).
        "tracing.off": MappingProxyType({"RELAYD_SINK__BATCH": "on"}),
        "tracing.on": MappingProxyType(
            {
                "RELAYD_SINK__BATCH": "on",
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_TRACES_SAMPLER": "always_on",
            }
        ),
    }
)


def relay_settings(key: str) -> dict[str, str]:
    """The RELAYD_* variables of one scenario (or scenario.mode)."""
    try:
        return dict(COMMON) | dict(RELAYD[key])
    except KeyError:
        raise KeyError(f"bench/settings.py has no relayd settings for {key!r}") from None

"""`relayd demo --sink webhook` as a newcomer meets it: the whole path on an embedded
PostgreSQL and an embedded receiver that verifies every signature, then the receiver's
deliveries checked against the outbox."""

from __future__ import annotations

from tests.support import run_relayd


async def test_the_webhook_demo_checks_every_delivery_at_the_receiver(
    cli_env: dict[str, str],
) -> None:
    """The demo delivers every order's event through dropped connections and 503s,
    dead-letters its three poison rows each with its reason, and its receiver check finds
    every published id verified under its own webhook-id: exit 0; its last lines suggest
    what to run next."""
    code, out, err = await run_relayd(
        "demo", "--sink", "webhook", "--rows", "200", env=cli_env, timeout_s=120
    )
    assert code == 0, out + err
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert lines["published"].split()[1] == "200"
    assert lines["dead-lettered"].endswith("3 (invalid_envelope 1, sink_rejected 1, too_large 1)")
    assert "receiver check     OK: " in out
    assert out.splitlines()[-3:] == [
        "next",
        "  look around    relayd demo --sink webhook --keep   (PostgreSQL and the receiver stay "
        "up for relayd status, relayd dlq list and the other operator commands)",
        '  a real server  the quick start for kind = "webhook" in README.md',
    ]

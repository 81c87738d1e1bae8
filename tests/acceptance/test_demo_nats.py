"""`relayd demo --sink nats` as a newcomer meets it: the whole path on an embedded PostgreSQL
and an embedded nats-server, then the stream read back and checked against the outbox."""

from __future__ import annotations

from tests.support import run_relayd


async def test_the_nats_demo_checks_every_event_in_the_stream(cli_env: dict[str, str]) -> None:
    """The demo publishes every order's event, reconciles the five already in the stream,
    dead-letters its four poison rows each with its reason (the conflict among them), and
    its stream check finds every published id once with its body and headers: exit 0; its
    last lines suggest what to run next."""
    code, out, err = await run_relayd(
        "demo", "--sink", "nats", "--rows", "300", env=cli_env, timeout_s=120
    )
    assert code == 0, out + err
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "300 (5 reconciled as already in the stream under their id)" in lines["published"]
    assert lines["dead-lettered"].endswith(
        "4 (conflict 1, invalid_envelope 1, no_route 1, too_large 1)"
    )
    assert "stream check       OK: 301 messages in EVENTS" in out
    assert out.endswith(
        "\nnext\n"
        "  look around    relayd demo --sink nats --keep   (PostgreSQL and nats-server stay up "
        "for relayd status, relayd dlq list and the other operator commands)\n"
        '  a real server  the quick start for kind = "nats" in README.md\n'
    )

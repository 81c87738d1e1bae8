"""The fence of routes whose subject holds the ordering key: the last sequence kept per
subject (the most recently used, bounded) and the header a fenced publish carries."""

from __future__ import annotations

from relayd.sinks.nats.fence import LastSequences, expected_of, expecting
from relayd.sinks.nats.message import NatsMessage


def test_the_most_recently_used_subjects_are_kept() -> None:
    seqs = LastSequences(size=2)
    seqs.put("events.a", 1)
    seqs.put("events.b", 2)
    assert seqs.get("events.a") == 1  # used: b is now the least recent
    seqs.put("events.c", 3)
    assert (seqs.get("events.a"), seqs.get("events.b"), seqs.get("events.c")) == (1, None, 3)
    seqs.put("events.a", 9)
    assert seqs.get("events.a") == 9
    assert len(seqs) == 2


def test_a_fenced_message_expects_the_subjects_last_sequence() -> None:
    message = NatsMessage("events.orders.k1", b"{}", {"Nats-Msg-Id": "e1"}, "events.orders.{key}")
    fenced = expecting(message, 41)
    assert fenced.headers == {"Nats-Msg-Id": "e1", "Nats-Expected-Last-Subject-Sequence": "41"}
    assert message.headers == {"Nats-Msg-Id": "e1"}  # the message itself is unchanged
    assert (fenced.subject, fenced.body, fenced.route) == (
        message.subject,
        message.body,
        message.route,
    )
    assert expected_of(fenced) == 41

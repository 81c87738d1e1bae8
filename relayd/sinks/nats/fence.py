"""The fence of a route whose subject holds the ordering key (`events.orders.{key}`: mode
`key_in_subject`), decided without I/O (docs/nats.md#ordered-routes).

Such a subject holds one key's events in the order the stream stored them. relayd publishes a
key's head expecting the subject's last sequence to be the one it last saw there
(`Nats-Expected-Last-Subject-Sequence`), so the stream stores the event only if nothing was
stored on the subject since:

- a late copy of an event (an attempt relayd gave up on, or a relay whose lease ran out while
  its message was on the way) that arrives after the key's next event is refused: the subject
  has moved on;
- a second store of the event (its first PubAck lost) is refused at any time, not only within
  the duplicate window: the refusal reads the subject's last message and finds the event.

relayd learns the sequence from each PubAck and keeps it per subject (bounded, least recently
used); a subject it has not seen is read first (`last_by_subj`). A kept sequence that is out of
date (another relay published on the subject since) can only make a publish be refused, never
let one through: a publish is stored only when what it expects is the subject's last message.
After such a refusal the sink reads the subject and, while the claim's send window is open (no
other relay can hold the key's head then), publishes once more expecting what it read.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from relayd.sinks.nats.dedupe import EXPECTED_LAST_SUBJECT_SEQ
from relayd.sinks.nats.message import NatsMessage

# Subjects whose last sequence is kept: one per key recently published; a key not among them
# costs one read before its next publish.
DEFAULT_KEPT = 65_536


class LastSequences:
    """The last sequence relayd saw on each key's subject, the most recently used kept."""

    def __init__(self, size: int = DEFAULT_KEPT) -> None:
        self._size = size
        self._seqs: OrderedDict[str, int] = OrderedDict()

    def get(self, subject: str) -> int | None:
        seq = self._seqs.get(subject)
        if seq is not None:
            self._seqs.move_to_end(subject)
        return seq

    def put(self, subject: str, seq: int) -> None:
        self._seqs[subject] = seq
        self._seqs.move_to_end(subject)
        if len(self._seqs) > self._size:
            self._seqs.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seqs)


def expecting(message: NatsMessage, seq: int) -> NatsMessage:
    """The event, stored only if the subject's last message is at `seq` (0: none)."""
    return dataclasses.replace(
        message, headers=message.headers | {EXPECTED_LAST_SUBJECT_SEQ: str(seq)}
    )


def expected_of(message: NatsMessage) -> int:
    """The sequence a fenced message expects."""
    return int(message.headers[EXPECTED_LAST_SUBJECT_SEQ])

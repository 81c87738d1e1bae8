"""Retries after a sink-wide failure: spread by jitter (C5), attempts refunded, nothing
dead-lettered, everything published once when the sink is back."""

from __future__ import annotations

from tests.faults import scenarios
from tests.faults.harness import Scene


async def test_rows_failed_together_are_retried_apart(scene: Scene) -> None:
    """One batch of 20 rows meets a 503: each row's next attempt is drawn on its own (full
    jitter over 0-5 s), so they do not come back as one herd."""
    await scenarios.rows_failed_together_retried_apart(scene)

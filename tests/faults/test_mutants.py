"""Negative controls: each deliberately broken relay (tests/faults/switches/mutants.py) makes
at least one fault scenario fail, with the violation that mutant should cause. A scenario
that still passed against a mutant would prove nothing about the rule that mutant breaks."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import pytest

from tests.faults import nats_scenarios, ordered, scenarios
from tests.faults.harness import Scene
from tests.faults.switches.mutants import MUTANTS

Scenario = Callable[[Scene], Awaitable[None]]

# mutant -> (the scenario that must catch it, what its failure must say)
CAUGHT_BY: dict[str, tuple[Scenario, str]] = {
    # Rows marked published, then the relay dies before sending them.
    "mark_before_post": (
        functools.partial(scenarios.kill_9_at_a_step, point="before_post"),
        r"falsely published \(\d+\)",
    ),
    # The frozen relay's late settle lands on rows its successor already published.
    "unfenced_settle": (
        functools.partial(scenarios.sigstop_past_the_lease, point="after_2xx"),
        r"stale token \(\d+\)",
    ),
    # The successor POSTs rows the dead relay had sent, on a sink that overwrites.
    "post_without_get": (
        functools.partial(scenarios.kill_9_at_a_step, point="after_2xx"),
        r"duplicated \(\d+\)",
    ),
    # The sink holds someone else's job under a row's id; the mutant records it published.
    "conflict_is_success": (
        functools.partial(scenarios.a_different_job_under_our_id, batch="off"),
        r"falsely published \(1\)",
    ),
    # A relay an hour ahead leases rows for an hour and dies: nobody may take them over.
    "host_clock_leases": (
        functools.partial(scenarios.a_wall_clock_off, shift_s=3600),
        r"rows still pending",
    ),
    "no_jitter": (scenarios.rows_failed_together_retried_apart, "distinct times"),
    # A starting relay takes the claims of a live relay whose database connection was cut.
    "lost_connection_is_death": (
        scenarios.alive_but_cut_off,
        r"claims of a live relay taken from it \(\d+\)",
    ),
    # A key's newest row claimed before its head: the sink sees the key out of order.
    "claims_a_later_row": (ordered.ordered_delivery, r"order violations \(\d+\)"),
    # The stream holds another message under a row's id; the mutant records it published.
    "duplicate_is_stored": (
        nats_scenarios.on_nats(nats_scenarios.same_id_different_body),
        r"falsely published \(1\)",
    ),
}

# A relay-wide rule holds for every sink: this mutant fails a NATS scenario too.
CAUGHT_ON_NATS: dict[str, tuple[Scenario, str]] = {
    "mark_before_post": (
        nats_scenarios.on_nats(
            functools.partial(nats_scenarios.kill_9_at_a_step, point="before_post")
        ),
        r"falsely published \(\d+\)",
    ),
}


# Mutants whose scenario needs more than a scene: their controls stand beside it.
CAUGHT_ELSEWHERE: dict[str, str] = {
    # The claim's WAL is lost when PostgreSQL crashes after the POST: rows created twice.
    "lazy_claim": "tests/faults/test_database_faults.py::test_a_lazy_claim_is_caught_by_the_crash",
}


def test_every_mutant_has_a_scenario_that_catches_it() -> None:
    missing = sorted(set(MUTANTS) - set(CAUGHT_BY) - set(CAUGHT_ELSEWHERE))
    assert not missing, f"mutants no scenario is shown to catch: {missing}"


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
async def test_the_mutant_fails_its_scenario(scene: Scene, mutant: str) -> None:
    scenario, says = CAUGHT_BY[mutant]
    scene.mutant = mutant
    with pytest.raises(AssertionError, match=says):
        await scenario(scene)


@pytest.mark.parametrize("mutant", sorted(CAUGHT_ON_NATS))
async def test_the_mutant_fails_its_nats_scenario(scene: Scene, mutant: str) -> None:
    scenario, says = CAUGHT_ON_NATS[mutant]
    scene.mutant = mutant
    with pytest.raises(AssertionError, match=says):
        await scenario(scene)

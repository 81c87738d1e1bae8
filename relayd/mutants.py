"""Mutants: deliberately broken relays, the fault suite's negative controls.

A fault suite proves something only if it fails on a relay that breaks the contract. Each
mutant below breaks one rule of docs/contract.md, the way a plausible bug would, and
tests/faults/test_mutants.py shows that at least one scenario catches each. A mutant is
selected by ``RELAYD_TEST_MUTANT=<name>`` in the environment of `relayd run` (read at
start-up with the failpoints); unset, `ACTIVE` is None and nothing below changes anything.

- ``mark_before_post``: the claim's rows are marked published before they are sent (C2);
- ``unfenced_settle``: the settles drop the owner-token predicate (C3);
- ``conflict_is_success``: a 409 counts as published, without the GET that compares (C2);
- ``post_without_get``: a row that may already be on the sink is POSTed again without a
  GET first (C2, on a sink that overwrites a reused id);
- ``host_clock_leases``: the claim reads "now" from this host's clock, not the database's
  (C3, once clocks disagree);
- ``no_jitter``: every backoff is its ceiling, so rows retried together stay together (C5).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final, Literal, get_args

ENV: Final = "RELAYD_TEST_MUTANT"

Mutant = Literal[
    "mark_before_post",
    "unfenced_settle",
    "conflict_is_success",
    "post_without_get",
    "host_clock_leases",
    "no_jitter",
]
MUTANTS: Final[tuple[str, ...]] = get_args(Mutant)

# The selected mutant, or None (always, outside the fault suite's negative controls).
ACTIVE: Mutant | None = None

_SETTLES: Final = ("settle_published", "settle_retry", "settle_dead", "release")


class MutantSpecError(ValueError):
    """``RELAYD_TEST_MUTANT`` names no mutant."""


def arm(environ: Mapping[str, str] = os.environ) -> None:
    """Select the mutant the environment names (none if unset or empty)."""
    global ACTIVE  # noqa: PLW0603 - one process-wide switch, set once at start-up
    name = environ.get(ENV, "").strip()
    if name and name not in MUTANTS:
        raise MutantSpecError(f"{name!r} is not one of {', '.join(MUTANTS)}")
    ACTIVE = name or None  # type: ignore[assignment]


def mutate_queries(queries: dict[str, str]) -> dict[str, str]:
    """The SQL of the selected mutant (the statements unchanged for the others)."""
    if ACTIVE == "unfenced_settle":
        for name in _SETTLES:
            queries[name] = queries[name].replace("o.lease_owner = $1", "$1::uuid IS NOT NULL")
    elif ACTIVE == "host_clock_leases":
        # "now" becomes a sixth parameter: the relay host's clock at the claim.
        queries["claim"] = queries["claim"].replace("now()", "$6::timestamptz")
    return queries

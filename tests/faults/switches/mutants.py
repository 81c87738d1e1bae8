"""Mutants: deliberately broken relays, the fault suite's negative controls.

A fault suite proves something only if it fails on a relay that breaks the contract. Each
mutant below breaks one rule of docs/contract.md, the way a plausible bug would, and
tests/faults/test_mutants.py shows that at least one scenario catches each. relayd itself
knows none of them: `install` replaces the methods a mutant breaks, and only the test
launcher (tests/faults/switches/launch.py) calls it, for a relay the fault suite starts with
``RELAYD_TEST_MUTANT=<name>``.

- ``mark_before_post``: the claim's rows are marked published before they are sent (C2);
- ``unfenced_settle``: the settles drop the owner-token predicate (C3);
- ``conflict_is_success``: a 409 counts as published, without the GET that compares (C2);
- ``post_without_get``: a row that may already be on the sink is POSTed again without a
  GET first (C2, on a sink that overwrites a reused id);
- ``host_clock_leases``: the claim reads "now" from this host's clock, not the database's
  (C3, once clocks disagree);
- ``no_jitter``: every backoff is its ceiling, so rows retried together stay together (C5);
- ``duplicate_is_stored``: a NATS duplicate's PubAck counts as published, without reading
  the stored message back to compare (C2);
- ``lazy_claim``: the claim commits without waiting for its WAL flush, as the settles do, so
  a database crash after the POST forgets the attempt and its successor sends again without
  reconciling (C2);
- ``claims_a_later_row``: the ordered claim takes a key's newest pending row instead of its
  head, so a later row of a key overtakes an earlier one (ordered delivery, C10);
- ``lost_connection_is_death``: a starting relay takes back every running lease, not only
  those of its own slot's dead predecessor, as a relay would that took a lost database
  connection for a dead process: a live relay cut off from PostgreSQL loses its claims
  before their lease ends (C4).
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, Literal, get_args

from tests.faults.switches.patches import Patches

ENV: Final = "RELAYD_TEST_MUTANT"

Mutant = Literal[
    "mark_before_post",
    "unfenced_settle",
    "conflict_is_success",
    "post_without_get",
    "host_clock_leases",
    "no_jitter",
    "duplicate_is_stored",
    "lazy_claim",
    "lost_connection_is_death",
    "claims_a_later_row",
]
MUTANTS: Final[tuple[str, ...]] = get_args(Mutant)

_SETTLES: Final = ("settle_published", "settle_retry", "settle_dead", "release")


class MutantSpecError(ValueError):
    """``RELAYD_TEST_MUTANT`` names no mutant."""


def selected(environ: Mapping[str, str]) -> str | None:
    """The mutant the environment names (None if unset or empty)."""
    name = environ.get(ENV, "").strip()
    if name and name not in MUTANTS:
        raise MutantSpecError(f"{name!r} is not one of {', '.join(MUTANTS)}")
    return name or None


class _Ceiling(random.Random):
    """A random source whose every uniform draw is the top of its range: no jitter."""

    def uniform(self, a: float, b: float) -> float:
        return b


def install(mutant: str, patches: Patches) -> None:
    """Break relayd the way `mutant` does, by replacing the methods it concerns."""
    from relayd.core.outcomes import NotFound, Published  # noqa: PLC0415
    from relayd.core.retry import Backoff  # noqa: PLC0415
    from relayd.engine.relay import RelayWorker  # noqa: PLC0415 - relayd only once a mutant runs
    from relayd.sinks.ojs.answers import Reconcile  # noqa: PLC0415
    from relayd.sinks.ojs.sink import OjsSink  # noqa: PLC0415
    from relayd.store import connection  # noqa: PLC0415
    from relayd.store.connection import StoreBase  # noqa: PLC0415

    if mutant == "mark_before_post":

        def publish(original: Any) -> Any:
            async def wrapped(self: RelayWorker, claim: Any) -> Any:
                held = [row.event_id for row in claim.rows]
                await self._ctx.store.settle_published(claim.owner, held, ["mutant"] * len(held))
                return await original(self, claim)

            return wrapped

        patches.wrap(RelayWorker, "publish", publish)
    elif mutant == "unfenced_settle":

        def unfenced(original: Any) -> Any:
            def load(table: Any) -> dict[str, str]:
                queries: dict[str, str] = original(table)
                for name in _SETTLES:
                    queries[name] = queries[name].replace(
                        "o.lease_owner = $1", "$1::uuid IS NOT NULL"
                    )
                return queries

            return load

        patches.wrap(connection, "load_queries", unfenced)
    elif mutant == "conflict_is_success":

        def post(original: Any) -> Any:
            async def wrapped(self: OjsSink, *args: Any) -> Any:
                posted = await original(self, *args)
                return Published(sink_state="conflict") if isinstance(posted, Reconcile) else posted

            return wrapped

        patches.wrap(OjsSink, "_post", post)
    elif mutant == "post_without_get":

        def reconcile(_original: Any) -> Any:
            async def wrapped(self: OjsSink, *_args: Any) -> Any:
                return NotFound()

            return wrapped

        patches.wrap(OjsSink, "reconcile", reconcile)
    elif mutant == "host_clock_leases":

        def host_clock(original: Any) -> Any:
            def load(table: Any) -> dict[str, str]:
                queries: dict[str, str] = original(table)
                # "now" becomes a last parameter: the relay host's clock at the claim.
                queries["claim"] = queries["claim"].replace("now()", "$7::timestamptz")
                queries["claim_ordered"] = queries["claim_ordered"].replace(
                    "now()", "$8::timestamptz"
                )
                return queries

            return load

        def fetch(original: Any) -> Any:
            async def wrapped(self: StoreBase, name: str, *args: Any) -> Any:
                if name in {"claim", "claim_ordered"}:
                    args += (datetime.now(UTC),)
                return await original(self, name, *args)

            return wrapped

        patches.wrap(connection, "load_queries", host_clock)
        patches.wrap(StoreBase, "_fetch", fetch)
    elif mutant == "no_jitter":

        def delay_s(original: Any) -> Any:
            def wrapped(self: Backoff, *args: Any) -> Any:
                return original(dataclasses.replace(self, rng=_Ceiling()), *args)

            return wrapped

        patches.wrap(Backoff, "delay_s", delay_s)
    elif mutant == "duplicate_is_stored":
        _duplicate_is_stored(patches)
    elif mutant == "lazy_claim":
        _lazy_claim(patches)
    elif mutant == "lost_connection_is_death":
        _lost_connection_is_death(patches)
    elif mutant == "claims_a_later_row":
        _claims_a_later_row(patches)
    else:
        raise MutantSpecError(f"{mutant!r} is not one of {', '.join(MUTANTS)}")


def _duplicate_is_stored(patches: Patches) -> None:
    from relayd.core.outcomes import Published  # noqa: PLC0415 - relayd only once a mutant runs
    from relayd.sinks.nats.sink import NatsSink  # noqa: PLC0415

    def read_back(_original: Any) -> Any:
        async def wrapped(self: NatsSink, *_args: Any) -> Any:
            return Published(sink_state="stored", reconciled=True)

        return wrapped

    patches.wrap(NatsSink, "_read_back", read_back)


def _claims_a_later_row(patches: Patches) -> None:
    from relayd.store import connection  # noqa: PLC0415 - relayd only once a mutant runs

    def tail_first(original: Any) -> Any:
        def load(table: Any) -> dict[str, str]:
            queries: dict[str, str] = original(table)
            claim = queries["claim_ordered"]
            # The walk meets each key at its newest row rather than its head.
            walked = claim.replace(
                "ORDER BY ordering_key, ordering_seq\n",
                "ORDER BY ordering_key, ordering_seq DESC\n",
            )
            walked = walked.replace(
                "ORDER BY o.ordering_key, o.ordering_seq\n",
                "ORDER BY o.ordering_key, o.ordering_seq DESC\n",
            )
            assert walked.count("ordering_seq DESC") == 2, "the walk's shape changed"
            queries["claim_ordered"] = walked
            return queries

        return load

    patches.wrap(connection, "load_queries", tail_first)


def _lazy_claim(patches: Patches) -> None:
    from relayd.store import connection  # noqa: PLC0415 - relayd only once a mutant runs

    def lazy(original: Any) -> Any:
        def load(table: Any) -> dict[str, str]:
            queries: dict[str, str] = original(table)
            for name, opening in (("claim", "WITH"), ("claim_ordered", "WITH RECURSIVE")):
                claim = queries[name]
                start = claim.index(f"{opening} durable AS (")
                durable = claim[start : claim.index("marks AS (", start)]
                # The settles' own device (cycle.sql), on the one statement that must not.
                queries[name] = claim.replace(
                    durable,
                    f"{opening} durable AS (SELECT set_config('synchronous_commit', 'off', "
                    "true)),\n",
                )
            return queries

        return load

    patches.wrap(connection, "load_queries", lazy)


def _lost_connection_is_death(patches: Patches) -> None:
    from relayd.store.cycle import CycleQueries  # noqa: PLC0415 - relayd only once a mutant runs

    def take_back(original: Any) -> Any:
        async def wrapped(self: CycleQueries, *_range: Any) -> Any:
            return await original(self, uuid.UUID(int=0), uuid.UUID(int=2**128 - 1))

        return wrapped

    patches.wrap(CycleQueries, "take_back", take_back)

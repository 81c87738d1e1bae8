"""The backlog as operators see it: the sampler, `relayd status`, the relays' heartbeats."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from relayd.store.connection import StoreBase, _translated

if TYPE_CHECKING:
    from relayd.core.backlog import Heartbeat


class BacklogQueries(StoreBase):
    """Rows come back as plain dicts; relayd/core/backlog.py and `relayd status` give them their
    meaning and types."""

    async def backlog_sample(self, limit: int, lease_s: float) -> dict[str, Any]:
        """The sampler's one bounded statement: each scan reads at most `limit` rows; leases
        are looked for among the rows due within `lease_s`."""
        records = await self._fetch("backlog_sample", str(self.table), limit, lease_s)
        return dict(records[0].items())

    async def status_rows(
        self, bound: int, top: int, lease_s: float, parked: int
    ) -> dict[str, list[dict[str, Any]]]:
        """Every part of `relayd status`, by query name, read in one read-only snapshot so
        that the parts agree (and share one now()); `parked`: how many of the keys parked
        longest it lists."""
        outbox = str(self.table)
        statements: dict[str, tuple[Any, ...]] = {
            "backlog_sample": (outbox, bound + 1, lease_s),
            "backlog_top": (bound, top),
            "dead_by_reason": (bound,),
            "pauses_list": (outbox,),
            "pauses_held": (outbox, bound),
            "instances_list": (outbox,),
            "parked_keys_oldest": (outbox, parked),
        }
        rows: dict[str, list[dict[str, Any]]] = {}
        with _translated("status"):
            async with (
                self._pool.acquire() as conn,
                conn.transaction(isolation="repeatable_read", readonly=True),
            ):
                for name, args in statements.items():
                    with _translated(name):
                        records = await conn.fetch(self._q[name], *args)
                        rows[name] = [dict(record.items()) for record in records]
        return rows

    async def heartbeat(self, beat: Heartbeat) -> None:
        """Insert or refresh a relay's row in relayd_instances; prune day-old rows."""
        with _translated("heartbeat"):
            await self._pool.execute(
                self._q["heartbeat"],
                str(self.table),
                beat.instance_id,
                beat.host,
                beat.pid,
                beat.version,
                beat.started_at,
                beat.breaker_state,
                beat.in_flight,
                json.dumps(beat.housekeeping),
                beat.breaker_reason,
            )

    async def heartbeat_delete(self, instance_id: uuid.UUID) -> None:
        with _translated("heartbeat_delete"):
            await self._pool.execute(self._q["heartbeat_delete"], str(self.table), instance_id)

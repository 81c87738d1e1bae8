"""Scripted faults for the OJS emulator: the rule type, its JSON form, and the plan that
decides which rule a request triggers.

A rule matches a method and a path (exact or prefix), optionally a job id the request
carries, and fires `times` times (`None`: until cleared). Its action is one of:

- `status`: answer the given status (error envelope, or a raw `body`) without processing;
- `latency`: wait `delay_ms`, then process normally;
- `drop`: abort the TCP connection without processing or answering;
- `store_then_drop`: process fully (the job IS stored), then abort without answering;
- `store_then_delay`: process fully, then answer after `delay_ms`;
- `store_then_status`: process fully, then answer the given status instead of the real one;
- `store_some_then_status`: for a batch, store only its first `count` jobs (default 1), then
  answer the given status as an error (a batch stored in part, then failed); any other
  request is processed fully first, as with `store_then_status`;
- `omit_ids`: process fully, then, for a batch answered 2xx, list only its first `count`
  jobs in the answer (the others are stored but omitted); any other answer is unchanged;
- `trickle`: process fully, then write the answer's status line and headers one byte at a
  time, `delay_ms` apart (the body at once after them), and close the connection: a client
  must give up on its own deadline;
- `oversized`: process fully, then answer the given status (200 unless set) with the real
  JSON body padded inside to `size_bytes` bytes (default 17 MiB, over relayd's limit of
  16 MiB on an answer), streamed in chunks.

`status` defaults to 503, except for `oversized` (200). `count` and `size_bytes` concern
only the actions that name them.

JSON form (``POST /_emulator/faults`` takes one rule, a list, or ``{"rules": [...]}``)::

    {"method": "POST", "path": "/ojs/v1/jobs", "job_id": "0190…", "times": 1,
     "action": "status", "status": 503, "code": "backend_error", "retry_after": "2"}

`path_prefix` replaces `path` for prefix matching; with neither, every OJS path matches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

FaultAction = Literal[
    "status",
    "latency",
    "drop",
    "store_then_drop",
    "store_then_delay",
    "store_then_status",
    "store_some_then_status",
    "omit_ids",
    "trickle",
    "oversized",
]
FAULT_ACTIONS: tuple[str, ...] = get_args(FaultAction)
# `status` unless given: what each action answers by default.
_DEFAULT_STATUS = 503
_ACTION_STATUS: Mapping[str, int] = {"oversized": 200}
DEFAULT_OVERSIZED_BYTES = 17 * 1024 * 1024
_MAX_OVERSIZED_BYTES = 1 << 30
_INT_FIELDS = ("times", "status", "delay_ms", "count", "size_bytes")
_REQUIRED_FIELDS = ("action", "method", "status", "delay_ms", "count", "size_bytes")


@dataclass(frozen=True)
class FaultRule:
    """One scripted misbehaviour; see the module docstring for the actions."""

    action: FaultAction
    method: str = "*"
    path: str | None = None
    path_prefix: str | None = None
    job_id: str | None = None
    times: int | None = 1
    # 0: the action's default (`_ACTION_STATUS`, else 503), resolved on construction.
    status: int = 0
    code: str | None = None
    retry_after: str | None = None
    delay_ms: int = 0
    body: str | None = None
    content_type: str | None = None
    # store_some_then_status: how many of the batch's jobs to store; omit_ids: how many to
    # list in the answer.
    count: int = 1
    # oversized: the answer's body size in bytes.
    size_bytes: int = DEFAULT_OVERSIZED_BYTES

    def __post_init__(self) -> None:
        if self.action not in FAULT_ACTIONS:
            raise ValueError(f"action must be one of {', '.join(FAULT_ACTIONS)}")
        if self.status == 0:
            object.__setattr__(self, "status", _ACTION_STATUS.get(self.action, _DEFAULT_STATUS))
        if self.path is not None and self.path_prefix is not None:
            raise ValueError("give path or path_prefix, not both")
        for name in ("path", "path_prefix"):
            value = getattr(self, name)
            if value is not None and not value.startswith("/"):
                raise ValueError(f"{name} must start with '/'")
        if self.times is not None and self.times < 1:
            raise ValueError("times must be >= 1 or null (until cleared)")
        if not 100 <= self.status <= 599:
            raise ValueError("status must be an HTTP status (100-599)")
        if self.delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        if self.count < 0:
            raise ValueError("count must be >= 0")
        if not 1 <= self.size_bytes <= _MAX_OVERSIZED_BYTES:
            raise ValueError(f"size_bytes must be between 1 and {_MAX_OVERSIZED_BYTES}")
        object.__setattr__(self, "method", self.method.upper())

    def matches(self, method: str, path: str, job_ids: Collection[str]) -> bool:
        """Whether a request with this method, path and carried job ids triggers the rule."""
        if self.method not in ("*", method.upper()):
            return False
        if self.path is not None and path != self.path:
            return False
        if self.path_prefix is not None and not path.startswith(self.path_prefix):
            return False
        return self.job_id is None or self.job_id in job_ids

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FaultRule:
        """Parse the JSON form; a ValueError names the offending field."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(unknown)}")
        if "action" not in data:
            raise ValueError("action is required")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            expected: type = int if name in _INT_FIELDS else str
            nullable = name not in _REQUIRED_FIELDS
            if value is None and nullable:
                kwargs[name] = None
                continue
            if isinstance(value, bool) or not isinstance(value, expected):
                raise ValueError(
                    f"{name} must be {'an integer' if expected is int else 'a string'}"
                )
            kwargs[name] = value
        kwargs["action"] = cast(FaultAction, kwargs["action"])
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        """The JSON form, without unset optional fields."""
        return {
            key: value
            for key, value in dataclasses.asdict(self).items()
            if value is not None or key == "times"
        }


@dataclass
class _Armed:
    rule_id: str
    rule: FaultRule
    fired: int = 0

    def exhausted(self) -> bool:
        return self.rule.times is not None and self.fired >= self.rule.times


class FaultPlan:
    """The armed rules, in the order they were added; the first live match fires. Rules
    naming a job id are also filed by it, so that thousands of them (a fault per event of a
    large run) cost a request only the rules of the ids it carries."""

    def __init__(self) -> None:
        self._armed: list[_Armed] = []
        self._by_job: dict[str, list[tuple[int, _Armed]]] = {}
        self._general: list[tuple[int, _Armed]] = []
        self._next_id = 1

    def add(self, rule: FaultRule) -> str:
        """Arm a rule; returns its id (``f1``, ``f2``, …)."""
        rule_id = f"f{self._next_id}"
        self._next_id += 1
        armed = _Armed(rule_id, rule)
        placed = (len(self._armed), armed)
        self._armed.append(armed)
        if rule.job_id is None:
            self._general.append(placed)
        else:
            self._by_job.setdefault(rule.job_id, []).append(placed)
        return rule_id

    def clear(self) -> int:
        """Disarm every rule; returns how many there were."""
        count = len(self._armed)
        self._armed.clear()
        self._by_job.clear()
        self._general.clear()
        return count

    def take(self, method: str, path: str, job_ids: Collection[str]) -> FaultRule | None:
        """The rule this request triggers, counted as fired; None if none matches."""
        candidates = [*self._general]
        for job_id in job_ids:
            candidates.extend(self._by_job.get(job_id, ()))
        for _, armed in sorted(candidates, key=lambda placed: placed[0]):
            if not armed.exhausted() and armed.rule.matches(method, path, job_ids):
                armed.fired += 1
                return armed.rule
        return None

    def fired(self, rule_id: str) -> int:
        """How many times the rule fired (0 for an unknown id)."""
        return next((armed.fired for armed in self._armed if armed.rule_id == rule_id), 0)

    def to_json(self) -> list[dict[str, Any]]:
        """Every rule with its id, fired count and remaining count (null: unlimited)."""
        return [
            {
                "id": armed.rule_id,
                **armed.rule.to_json(),
                "fired": armed.fired,
                "remaining": None
                if armed.rule.times is None
                else max(armed.rule.times - armed.fired, 0),
            }
            for armed in self._armed
        ]

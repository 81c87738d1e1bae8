"""The deadlines of one runner's attempts (relay.py): what `asyncio.timeout_at` gives each
attempt, with one timer per runner instead of a timer made and cancelled per attempt.

A runner makes its attempts one after another, each with a deadline counted from its own
start, so each deadline is at or after the one before (unless the drain cuts it, see
`reschedule`). A timer armed for an earlier deadline is therefore moved on only when it
fires and finds a later attempt running: with attempts much shorter than sink.timeout_s,
about once per timeout, not once per request. What an attempt sees is what
`asyncio.timeout_at` does: at its deadline the task is cancelled, and the cancellation comes
out of the `with` block as `TimeoutError`, unless someone else cancelled the task too.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType


class AttemptDeadlines:
    """One runner's attempt deadlines; made in the runner's task, `close`d when it ends."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("attempt deadlines need a task")
        self._task = task
        self._loop = asyncio.get_running_loop()
        self._when: float | None = None  # the running attempt's deadline; None between them
        self._expired = False  # the running attempt's deadline passed: its task was cancelled
        self._cancelling = 0  # the task's pending cancellations when the attempt began
        self._timer: asyncio.Handle | None = None
        self._armed_for = math.inf  # the deadline the timer was set for

    def when(self) -> float | None:
        """The running attempt's deadline (loop time); None between attempts."""
        return self._when

    def until(self, when: float) -> AttemptDeadlines:
        """The next attempt's deadline, for `with`: the attempt runs inside the block."""
        if self._when is not None:
            raise RuntimeError("an attempt is already running under these deadlines")
        self._when = when
        self._expired = False
        self._cancelling = self._task.cancelling()
        if when < self._armed_for:  # no timer, or one set for later (a cut deadline)
            self._arm(when)
        return self

    def reschedule(self, when: float) -> None:
        """Move the running attempt's deadline to `when` (the drain's grace). Between
        attempts there is nothing to move: the next one's deadline is decided as it starts."""
        if self._when is None or self._expired:
            return
        self._when = when
        if when < self._armed_for:
            self._arm(when)

    def close(self) -> None:
        """The runner is done: no timer is left behind."""
        self._when = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._armed_for = math.inf

    def __enter__(self) -> AttemptDeadlines:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The timer stays armed: the next attempt's deadline is later, and the timer moves
        # on to it when it fires (or `close` cancels it).
        self._when = None
        if not self._expired:
            return
        self._expired = False
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            # No other cancellation is pending: this one is the deadline's.
            raise TimeoutError from exc

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = when
        if when <= self._loop.time():
            self._timer = self._loop.call_soon(self._fire)
        else:
            self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        armed_for, self._armed_for, self._timer = self._armed_for, math.inf, None
        when = self._when
        if when is None or self._expired:
            return  # between attempts: the next one arms the timer as it starts
        if when <= armed_for:
            self._expired = True
            self._task.cancel()
        else:
            self._arm(when)  # a later attempt is running: its own deadline

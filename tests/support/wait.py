"""The one way tests wait: poll a condition until it holds or a deadline passes.

Tests never sleep for a state to arrive; they name the state as a condition and wait for it with a
deadline. A wait that times out fails with what it waited for and the value the condition last returned,
so a flaky wait says how far it got. (Sleeping stays legitimate only to pace a load or to keep a window
open in which something must *not* happen; such sleeps say so in a comment.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["WaitTimeout", "wait_for"]


class WaitTimeout(AssertionError):
    """A condition did not hold within its deadline (an AssertionError, so pytest reports it as a failure)."""


def wait_for(condition: Callable[[], object], timeout: float, what: str, *, interval: float = 0.01) -> float:
    """Poll ``condition`` every ``interval`` seconds until it returns a truthy value; return the seconds it took.

    Raises :class:`WaitTimeout` naming ``what`` and the last value ``condition`` returned when it has not
    held after ``timeout`` seconds. The condition is checked once more at the deadline, so a slow poll never
    fails a condition that holds. Exceptions from the condition propagate: a wait is no place to hide them.
    """
    started = time.monotonic()
    deadline = started + timeout
    while True:
        observed = condition()
        if observed:
            return time.monotonic() - started
        now = time.monotonic()
        if now >= deadline:
            raise WaitTimeout(f"timed out after {timeout:.1f} s waiting for {what} (last observed: {observed!r})")
        time.sleep(min(interval, deadline - now))

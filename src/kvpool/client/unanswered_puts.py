"""Keys of this client's puts whose BatchPutStart went unanswered (the call timed out).

The master may still have carried such a start out: the key is then an unfinished put of this client that
nobody writes. A later put of the key is answered OBJECT_NOT_READY, which a client counts as success ("on its
way"), and the master reclaims the key after ``put_timeout_s``: an acknowledged put would be lost. The client
revokes those keys at once, but that revoke can fail (the master is slow, the circuit breaker opened) or
overtake the start on another connection; so it also remembers them here, and a later put that finds one of
them OBJECT_NOT_READY revokes it and asks again instead of counting it as done.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["UnansweredPuts"]

DEFAULT_LIMIT = 1 << 14
"""Most keys remembered (the oldest forgotten first: the master reclaims those after put_timeout_s)."""


class UnansweredPuts:
    """A bounded, thread-safe set of keys (see the module docstring)."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._limit = limit
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def note(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def forget(self, key: str) -> bool:
        """Whether ``key`` was remembered (it is not any more)."""
        if not self._keys:  # the common case: no unanswered put, no lock
            return False
        with self._lock:
            return self._keys.pop(key, 0) is None

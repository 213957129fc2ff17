"""The replica descriptors of objects this client holds a live read lease on, and the renewal of the
leases of the ones it keeps reading.

A read lease is the master's promise that, until it ends, the object is not evicted, not removed
(unless forced) and not moved off its segment (a drain frees the source only after the leases granted
before the move have ended). So while the lease holds, the descriptors and the grant that came with it
are as good as fresh ones: a client that reads the same object again - the hot prefix of a system
prompt, re-read by every request that shares it - can skip the master and make the read one data round
trip. An entry is used only until ``margin_ms`` before its lease (or grant) ends, so that the read
completes under the lease; the read still checks the checksum and the lease expiry as any other.

**Renewal.** An entry read again in the last third of its life is renewed in the background
(:class:`LeaseRenewer`: one batched get-replicas call for all the keys that came due within
``linger_s``), while the reads go on using the entry. Without it every hot object fell out of the cache
at the same moment once per lease, and each of its next reads paid the master round trip again
(docs/decisions/0012-lease-renewal.md has the figures). The renewal is a leased read at the
master, so it also refreshes the object's last access there: a hot object read only from this cache is
not evicted as cold. An object read once is not renewed; its entry simply ends with its lease.

What this gives up, and why it is safe: reads served here are not counted one by one at the master - which
is also why objects held only on an SSD tier are never cached: the master counts their reads to promote
them - and an object another client *force*-removes may still be read from a live entry until the lease
ends - the same race a read that fetched its descriptors just before the removal has, stretched to one
lease. A cached read that fails in any way (the range was reused: checksum mismatch; the store restarted:
segment not found) drops the entry and asks the master.

**Hints** (``keep_hints``; decision 0014). An entry whose lease has ended is kept, as a hint of where the
object was: ``hint(key)`` returns it, and a read from it asks for its renewal (``hint_used``: again at
most once a second while the renewal does not land). The client reads from a hint with a *revalidated*
read: the store serves it only if it still holds exactly that object (same key, range and checksum,
nothing written over it since), and the landed bytes are checked against the checksum as always. So a
re-read after the lease ran out is still one data round trip, and the renewal it asks for refreshes the
master's LRU in the background.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvpool.common.clock import Clock
from kvpool.common.log import get_logger

logger = get_logger(__name__)

# An entry read after this fraction of its usable life asks for a renewal: the remaining third (~3 s of a
# 10 s lease) leaves the renewal seconds to complete before the entry would end.
RENEW_AFTER = 2 / 3
# A hint asks for its renewal again after this long if the last one did not land (master unreachable).
RENEW_RETRY_MS = 1000


class LeaseCache:
    """A bounded, thread-safe map key -> resolved master answer (code, size, checksum, lease expiry,
    replicas), least recently used out first. ``on_renewal_due(key)`` (if given) is called, once per
    entry, when an entry is read in the last third of its life."""

    def __init__(
        self,
        max_entries: int,
        clock: Clock,
        margin_ms: int = 1000,
        on_renewal_due: Callable[[str], None] | None = None,
        keep_hints: bool = False,
    ) -> None:
        self._max = max_entries
        self._clock = clock
        self._margin_ms = margin_ms
        self._on_renewal_due = on_renewal_due
        self._keep_hints = keep_hints
        # key -> (usable until, renewal due at, result); both times in wall ms
        self._entries: OrderedDict[str, tuple[int, int, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._drops = 0  # drop() and clear() calls so far: a renewal that overlapped one keeps nothing

    @property
    def drops(self) -> int:
        """A count that changes with every ``drop`` and ``clear``: pass it to ``put`` as ``unless_dropped_since``."""
        return self._drops

    @property
    def enabled(self) -> bool:
        return self._max > 0

    @property
    def keeps_hints(self) -> bool:
        return self._keep_hints and self._max > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        """The cached result, if its lease still has ``margin_ms`` to run."""
        now = self._clock.wall_ms()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            until, renew_at, result = entry
            if until <= now:
                if not self._keep_hints:
                    del self._entries[key]
                return None
            self._entries.move_to_end(key)
            due = renew_at <= now
            if due:  # asked once: the renewal's put() sets a new due time
                self._entries[key] = (until, until, result)
        if due and self._on_renewal_due is not None:
            self._on_renewal_due(key)
        return result

    def knows(self, key: str) -> bool:
        """Whether there is an entry for ``key``, live or a hint (no side effect: no renewal, no reordering)."""
        return key in self._entries

    def hint(self, key: str) -> Any | None:
        """The result of an entry whose lease has ended (kept with ``keep_hints``): where the object was.
        A caller that reads from it calls :meth:`hint_used`."""
        now = self._clock.wall_ms()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] > now:
                return None
            self._entries.move_to_end(key)
            return entry[2]

    def hint_used(self, key: str) -> None:
        """A read is served from the hint of ``key``: ask for its renewal, at most once per ``RENEW_RETRY_MS``
        (a renewal that lands replaces the entry; one that cannot reach the master is asked again)."""
        now = self._clock.wall_ms()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[1] > now:
                return
            self._entries[key] = (entry[0], now + RENEW_RETRY_MS, entry[2])
        if self._on_renewal_due is not None:
            self._on_renewal_due(key)

    def put(self, key: str, result: Any, unless_dropped_since: int | None = None) -> None:
        """Remember a readable result (code OK, with replicas) of a leased lookup, replacing any earlier
        one. An object with no DRAM replica is not kept (and an earlier entry is dropped): the master
        counts its reads to decide when to promote it from SSD. With ``unless_dropped_since`` (a
        ``drops`` value read before the lookup) nothing is kept if entries were dropped meanwhile: a
        background renewal must not bring back the entry of an object this client has just removed."""
        self.put_many([(key, result)], unless_dropped_since)

    def put_many(self, items: Sequence[tuple[str, Any]], unless_dropped_since: int | None = None) -> None:
        """``put`` of each (key, result), under one clock reading and one acquisition of the lock (the
        answers of one batched lookup; docs/decisions/0050-measurements.md has the saving)."""
        if not self._max or not items:
            return
        now = self._clock.wall_ms()
        margin = self._margin_ms
        renews = self._on_renewal_due is not None
        staged = []
        for key, result in items:
            until = result.lease_expiry_ms
            in_dram = False
            for replica in result.replicas:
                until = min(until, replica.expiry_ms)
                in_dram = in_dram or replica.tier == 0
            until -= margin
            if not (in_dram and until > now):
                staged.append((key, 0, 0, None))
                continue
            staged.append((key, until, now + int((until - now) * RENEW_AFTER) if renews else until, result))
        with self._lock:
            if unless_dropped_since is not None and unless_dropped_since != self._drops:
                return
            entries = self._entries
            for key, until, renew_at, kept in staged:
                if kept is None:  # not a removal by the client: it does not count as a drop
                    entries.pop(key, None)
                    continue
                entries[key] = (until, renew_at, kept)
                entries.move_to_end(key)
            while len(entries) > self._max:
                entries.popitem(last=False)

    def drop(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._drops += 1
            for key in keys:
                self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._drops += 1
            self._entries.clear()


class LeaseRenewer:
    """A background thread that renews leases in batches: keys come in one at a time (from reads, through
    ``request``); the thread waits ``linger_s`` after the first so that the keys coming due together go in
    one call of ``renew(keys)`` (at most ``max_batch`` keys a call). Started on the first request."""

    def __init__(self, renew: Callable[[list[str]], None], linger_s: float = 0.02, max_batch: int = 1024) -> None:
        self._renew = renew
        self._linger_s = linger_s
        self._max_batch = max_batch
        self._keys: dict[str, None] = {}  # insertion-ordered set: a key asked twice is renewed once
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def request(self, key: str) -> None:
        with self._cond:
            if self._closed:
                return
            self._keys[key] = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="kvpool-lease-renewer")
                self._thread.start()
            if len(self._keys) == 1:  # the thread waits for a first key; later ones join its batch
                self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (a renewal in progress finishes first, within its deadline)."""
        with self._cond:
            self._closed = True
            self._keys.clear()
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._keys and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                end = time.monotonic() + self._linger_s  # collect the keys coming due together
                while not self._closed and (left := end - time.monotonic()) > 0:
                    self._cond.wait(left)
                if self._closed:
                    return
                keys = list(self._keys)[: self._max_batch]
                for key in keys:
                    del self._keys[key]
            try:
                self._renew(keys)
            except Exception:  # a renewal is an optimisation: a failure leaves the entries to end
                logger.exception("lease renewal of %d keys failed", len(keys))

"""Master leader election through etcd (docs/decisions/0004-ha-election.md): mechanism only, no master logic.

Protocol, per elector (one per master replica):

1. **Campaign.** Grant a lease (kept alive by a :class:`LeaseKeeper`) and write ``/kvpool/<cluster>/leader``
   = JSON(my_info), bound to that lease:

   * if the key is absent: ``create_if_absent`` (compare create_revision == 0). The previous leader, if
     any, lost its lease; it may not have noticed yet, so the winner **warms up for one lease TTL** before
     serving (by then the old leader's keeper has reported the loss: its local expiry estimate is never
     later than etcd's);
   * if the key holds the vacancy marker of a leader that resigned cleanly: compare-and-put on the
     marker's mod_revision. The resigner stopped serving *before* writing the marker, so the winner serves
     at once: that is what makes ``resign()`` (SIGTERM) a fast handover.

   The **view** is the revision of the winning write. Revisions only grow, so views strictly increase across
   elections and fence any stale leader (stores and clients refuse an older view).
2. **Lead.** Call ``on_elected(view)``; keep renewing; call ``on_deposed()`` as soon as the lease is lost
   (renewals failed for a TTL, or etcd says it is gone) or a watch shows the key deleted or rewritten.
3. **Follow.** Watch the key; campaign again when it is deleted, expires or becomes vacant.

The elector runs one daemon thread; ``on_elected`` and ``on_deposed`` run on it, strictly alternating,
and should return quickly (hand the work to the master's own loop). ``on_deposed`` must stop the master
serving as leader before it returns: a clean resignation publishes the vacancy right after it.
Stale leaders are fenced by views, not by timing: a process frozen past its lease (SIGSTOP, a long GC or
swap) still believes it leads until its threads run again, then deposes itself at once.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvpool.common.coordinator import Coordinator, LeaseHandle, WatchHandle
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd import EventType, KeyValue, WatchEvent
from kvpool.common.leader_watch import VACANT_FIELD, LeaderInfo, leader_key, parse_leader, vacancy_value
from kvpool.common.log import get_logger

__all__ = ["ElectorState", "LeaderElector", "LeaderInfo"]

log = get_logger(__name__)


class ElectorState(Enum):
    IDLE = "idle"  # not started
    CANDIDATE = "candidate"  # following, campaigning whenever the key is free
    WARMING_UP = "warming_up"  # won the key, waiting one TTL before serving
    LEADER = "leader"  # on_elected has been called
    STOPPED = "stopped"


@dataclass(frozen=True)
class _Event:
    kind: str  # "watch" | "lease_lost" | "stop"
    watch: WatchEvent | None = None
    generation: int = 0
    resign: bool = False


class LeaderElector:
    """Campaigns for ``/kvpool/<cluster>/leader`` on behalf of one master replica; see the module docstring.

    ``ttl_s`` is the lease TTL (etcd rounds it up to whole seconds and to its own minimum); it bounds how
    long the cluster stays leaderless after a leader crash (about ``ttl`` to expire + ``ttl`` warm-up).
    ``etcd`` is any :class:`Coordinator`: an ``EtcdClient`` in production, an in-memory fake in unit tests.
    """

    def __init__(
        self,
        etcd: Coordinator,
        cluster: str,
        my_info: dict[str, Any],
        ttl_s: float = 5.0,
        on_elected: Callable[[int], None] | None = None,
        on_deposed: Callable[[], None] | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self._etcd = etcd
        self._key = leader_key(cluster)
        if VACANT_FIELD in my_info:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"my_info may not contain {VACANT_FIELD!r}")
        self._value = json.dumps(my_info, sort_keys=True, separators=(",", ":")).encode()
        self._ttl_s = ttl_s
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._name = name or str(my_info.get("id", "elector"))
        self._events: queue.Queue[_Event] = queue.Queue()
        self._lock = threading.Lock()  # guards the fields other threads read
        self._state = ElectorState.IDLE
        self._view = 0
        self._keeper: LeaseHandle | None = None
        self._generation = 0  # tags lease-loss events so that a stale keeper's report is ignored
        self._current: KeyValue | None = None  # the leader key as last seen (elector thread only)
        self._current_rev = 0  # the revision self._current was known at, so that old news cannot win
        self._seen_key = False
        self._warm_until = 0.0
        self._watcher: WatchHandle | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._was_leader_at_stop = False

    # ---- public API ----------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def state(self) -> ElectorState:
        with self._lock:
            return self._state

    @property
    def view(self) -> int:
        """The view of the current (or, once deposed, the last) leadership of this elector; 0 if never won."""
        with self._lock:
            return self._view

    @property
    def is_leader(self) -> bool:
        return self.state is ElectorState.LEADER

    @property
    def is_warming_up(self) -> bool:
        return self.state is ElectorState.WARMING_UP

    @property
    def lease_id(self) -> int:
        keeper = self._keeper
        return keeper.lease_id if keeper is not None else 0

    def lease_valid_for(self) -> float:
        """Seconds this elector's lease surely stays valid (local, conservative estimate; 0 without one).

        A master checks this on every request, so a leader frozen past its lease (SIGSTOP) refuses to
        answer the moment it runs again, before its elector thread has even noticed the loss.
        """
        keeper = self._keeper
        return max(0.0, keeper.expires_in) if keeper is not None and not keeper.lost else 0.0

    def start(self) -> None:
        """Start campaigning in a daemon thread."""
        with self._lock:
            if self._state is not ElectorState.IDLE:
                raise KvPoolError(ErrorCode.INTERNAL, "LeaderElector.start() called twice")
            self._state = ElectorState.CANDIDATE
        self._watcher = self._etcd.watch(self._key, None, lambda ev: self._events.put(_Event("watch", ev)))
        self._thread = threading.Thread(target=self._run, name=f"elector-{self._name}", daemon=True)
        self._thread.start()

    def current_leader(self, *, timeout: float | None = None) -> LeaderInfo | None:
        """The leader published in etcd now (a linearizable read); None if there is none."""
        return parse_leader(self._etcd.get(self._key, timeout=timeout))

    def resign(self, timeout: float | None = None) -> bool:
        """Step down cleanly and stop campaigning (SIGTERM): ``on_deposed``, then publish the vacancy so
        that another replica takes over without the warm-up. Returns True if this elector was leading or
        warming up. Waits at most ``timeout`` (default: the etcd client's timeout + 1 s)."""
        return self._shutdown(resign=True, timeout=timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Stop campaigning. A leading elector steps down as in :meth:`resign` (leaving the key to expire
        would only make the cluster wait a TTL and a warm-up for nothing)."""
        self._shutdown(resign=False, timeout=timeout)

    # ---- shutdown ------------------------------------------------------------------------------------------

    def _shutdown(self, *, resign: bool, timeout: float | None) -> bool:
        thread = self._thread
        if thread is None:
            with self._lock:
                self._state = ElectorState.STOPPED
            return False
        self._events.put(_Event("stop", resign=resign))
        if thread is not threading.current_thread():
            thread.join(timeout if timeout is not None else self._etcd.timeout * 2 + 1.0)
            if thread.is_alive():
                log.warning("elector %s: did not stop within the timeout", self._name)
        return self._was_leader_at_stop

    # ---- the elector thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.1
        try:
            while not self._stopped.is_set():
                try:
                    self._step()
                    backoff = 0.1
                except KvPoolError as e:
                    log.warning("elector %s: %s", self._name, e)
                    self._wait_event(backoff)  # etcd trouble: retry later, still serving events
                    backoff = min(backoff * 2, max(1.0, self._ttl_s / 3))
        except Exception:
            log.exception("elector %s crashed", self._name)
            self._step_down(vacate=False)
        finally:
            if self._watcher is not None:
                self._watcher.stop()
            with self._lock:
                self._state = ElectorState.STOPPED

    def _step(self) -> None:
        state = self.state
        if state is ElectorState.CANDIDATE:
            self._candidate_step()
        elif state is ElectorState.WARMING_UP:
            self._warmup_step()
        elif state is ElectorState.LEADER:
            self._wait_event(None)

    def _candidate_step(self) -> None:
        if not self._seen_key:
            # Learn the key's state before campaigning, instead of a doomed create that costs a lease.
            if not self._wait_event(self._etcd.timeout):
                kvs, revision = self._etcd.read(self._key)
                self._current, self._current_rev = (kvs[0] if kvs else None), revision
                self._seen_key = True
            return
        cur = self._current
        if cur is None or _is_vacant(cur):
            self._campaign(cur)
            return
        # Someone leads: wait for a change. Re-read once per TTL in case the watch lags behind.
        if not self._wait_event(max(1.0, self._ttl_s)):
            kvs, revision = self._etcd.read(self._key)
            self._current, self._current_rev = (kvs[0] if kvs else None), revision

    def _campaign(self, vacant: KeyValue | None) -> None:
        with self._lock:
            self._generation += 1
            generation = self._generation
        keeper = self._etcd.keep_lease(
            self._ttl_s,
            on_lost=lambda: self._events.put(_Event("lease_lost", generation=generation)),
            name=f"leader-{self._name}",
        )
        lease = keeper.start()
        try:
            if vacant is None:
                won, revision, existing = self._etcd.create_if_absent(self._key, self._value, lease)
            else:
                won, revision, existing = self._etcd.put_if_mod_revision(
                    self._key, vacant.mod_revision, self._value, lease
                )
        except KvPoolError:
            keeper.stop(revoke=True)
            raise
        if not won:
            keeper.stop(revoke=True)
            self._current, self._current_rev = existing, revision
            return
        warmup = 0.0 if vacant is not None else float(keeper.ttl)
        with self._lock:
            self._keeper, self._view, self._state = keeper, revision, ElectorState.WARMING_UP
        self._warm_until = time.monotonic() + warmup
        log.info(
            "elector %s: won %s with view %d (lease %x, ttl %ds); %s",
            self._name,
            self._key,
            revision,
            lease,
            keeper.ttl,
            "previous leader resigned: serving now" if vacant is not None else f"warming up for {warmup:.0f}s",
        )

    def _warmup_step(self) -> None:
        remaining = self._warm_until - time.monotonic()
        if remaining > 0:
            self._wait_event(remaining)
            return
        # Confirm with a linearizable read: the watch may not have shown a loss yet.
        kv = self._etcd.get(self._key)
        if not self._owns(kv):
            log.warning("elector %s: lost %s during warm-up", self._name, self._key)
            self._step_down(vacate=False)
            return
        with self._lock:
            self._state = ElectorState.LEADER
            view = self._view
        log.info("elector %s: leader with view %d", self._name, view)
        self._call(lambda: self._on_elected(view) if self._on_elected else None, "on_elected")

    # ---- events --------------------------------------------------------------------------------------------

    def _wait_event(self, timeout: float | None) -> bool:
        """Handle the next event (waiting up to ``timeout``); False if none came."""
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return False
        self._handle(event)
        return True

    def _handle(self, event: _Event) -> None:
        if event.kind == "stop":
            self._handle_stop(event.resign)
        elif event.kind == "lease_lost":
            if event.generation == self._generation and self.state in (
                ElectorState.WARMING_UP,
                ElectorState.LEADER,
            ):
                log.warning("elector %s: lease lost; stepping down", self._name)
                self._step_down(vacate=False)
        elif event.watch is not None:
            self._handle_watch(event.watch)

    def _handle_watch(self, event: WatchEvent) -> None:
        kv = event.kv if event.type is EventType.PUT else None
        self._seen_key = True
        if event.revision >= self._current_rev:
            self._current, self._current_rev = kv, event.revision
        if self.state not in (ElectorState.WARMING_UP, ElectorState.LEADER):
            return
        if self._owns(kv) or event.revision <= self.view:
            return  # our own win, or older news
        log.warning(
            "elector %s: %s was %s at revision %d; stepping down",
            self._name,
            self._key,
            "rewritten" if kv else "deleted",
            event.revision,
        )
        self._step_down(vacate=False)

    def _handle_stop(self, resign: bool) -> None:
        state = self.state
        self._was_leader_at_stop = state in (ElectorState.WARMING_UP, ElectorState.LEADER)
        if self._was_leader_at_stop:
            log.info("elector %s: %s", self._name, "resigning" if resign else "stopping; handing over")
            self._step_down(vacate=True)
        self._stopped.set()

    # ---- leaving the leadership ----------------------------------------------------------------------------

    def _step_down(self, *, vacate: bool) -> None:
        """Leave WARMING_UP/LEADER: ``on_deposed`` first (if ``on_elected`` ran), then release the key."""
        with self._lock:
            was_leader = self._state is ElectorState.LEADER
            keeper, self._keeper = self._keeper, None
            self._state = ElectorState.CANDIDATE
            self._generation += 1
            view = self._view
        if was_leader:
            self._call(lambda: self._on_deposed() if self._on_deposed else None, "on_deposed")
        if keeper is None:
            return
        if vacate and not keeper.lost:
            try:
                # Only if the key is still ours: the compare is on the mod_revision of our winning write.
                self._etcd.put_if_mod_revision(self._key, view, vacancy_value(view), 0)
            except KvPoolError as e:
                log.warning("elector %s: could not publish the vacancy (%s); the lease will expire", self._name, e)
        keeper.stop(revoke=True)  # deletes the key if it is still bound to our lease

    def _owns(self, kv: KeyValue | None) -> bool:
        keeper = self._keeper
        return (
            kv is not None
            and keeper is not None
            and kv.lease == keeper.lease_id
            and kv.mod_revision == self.view
            and kv.value == self._value
        )

    def _call(self, fn: Callable[[], object], what: str) -> None:
        try:
            fn()
        except Exception:
            log.exception("elector %s: %s callback failed", self._name, what)


def _is_vacant(kv: KeyValue) -> bool:
    try:
        doc = json.loads(kv.value)
    except ValueError:
        return False
    return isinstance(doc, dict) and VACANT_FIELD in doc and kv.lease == 0

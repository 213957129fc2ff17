"""Dead-store suspicion: the pure rules (no I/O; MasterState applies them, the service runs the probes).

A store that dies is noticed by the clients long before its heartbeat TTL runs out: their data-plane
connections fail. A client reports such a failure (ReportStoreFailures); the master then suspects the
store - it stops placing on it and answers lookups of objects readable only there as misses - when

* reports of at least ``agreement`` distinct clients arrive within ``report_window_s`` (when the master's
  ``store_report_agreement`` is set; 0, its default, leaves only the probe), or
* its own probe of the store's data-plane port fails (a probe is asked for by a lone report; a
  successful probe clears the reports, so one client cannot take a healthy store out of service).

The suspicion lifts when the store heartbeats (or mounts) after the suspicion began.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    """What a report leads to."""

    SUSPECTED = "suspected"
    """The store is suspected now (newly or already)."""
    PROBE = "probe"
    """One client says so: the master must probe the store before it suspects it."""
    WAIT = "wait"
    """A probe of this store is already under way or was made moments ago; nothing to do."""


class StoreSuspicion:
    """Reports, probes and suspicions per store id; every method takes the caller's ``now`` (monotonic s).

    Not thread-safe: MasterState calls it under its membership lock.
    """

    def __init__(self, agreement: int = 2, report_window_s: float = 2.0, probe_interval_s: float = 0.5) -> None:
        self.agreement = agreement
        self.report_window_s = report_window_s
        self.probe_interval_s = probe_interval_s
        self._reports: dict[str, dict[str, float]] = {}
        """store id -> client id -> time of its latest report (only reports within the window count)."""
        self._suspected: dict[str, float] = {}
        """store id -> when the suspicion began."""
        self._last_probe: dict[str, float] = {}

    def is_suspected(self, store_id: str) -> bool:
        return store_id in self._suspected

    @property
    def suspected(self) -> dict[str, float]:
        """Suspected store ids and when each suspicion began (a copy)."""
        return dict(self._suspected)

    def report(self, store_id: str, client_id: str, now: float) -> Verdict:
        """A client could not connect to the store's data plane."""
        if store_id in self._suspected:
            return Verdict.SUSPECTED
        reports = self._reports.setdefault(store_id, {})
        for client, at in list(reports.items()):
            if now - at > self.report_window_s:
                del reports[client]
        reports[client_id] = now
        if self.agreement and len(reports) >= self.agreement:
            self._suspect(store_id, now)
            return Verdict.SUSPECTED
        last = self._last_probe.get(store_id)
        if last is not None and now - last < self.probe_interval_s:
            return Verdict.WAIT
        self._last_probe[store_id] = now
        return Verdict.PROBE

    def probe_result(self, store_id: str, reachable: bool, now: float) -> bool:
        """The master's own probe of the store's data plane; True when it made the store suspected."""
        if reachable:
            self._reports.pop(store_id, None)  # the reports were wrong (or the failure was the client's)
            return False
        if store_id in self._suspected:
            return False
        self._suspect(store_id, now)
        return True

    def heartbeat(self, store_id: str, now: float) -> bool:
        """The store heartbeated (or mounted); True when this lifted its suspicion."""
        since = self._suspected.get(store_id)
        if since is None or now <= since:
            return False
        self.forget(store_id)
        return True

    def forget(self, store_id: str) -> None:
        """The store is gone (expired, unmounted) or healthy again: no reports, no suspicion."""
        self._suspected.pop(store_id, None)
        self._reports.pop(store_id, None)
        self._last_probe.pop(store_id, None)

    def _suspect(self, store_id: str, now: float) -> None:
        self._suspected[store_id] = now
        self._reports.pop(store_id, None)


@dataclass(frozen=True, slots=True)
class SuspicionReport:
    """MasterState's answer to a client's failure report."""

    suspected: list[str]
    """Reported data-plane endpoints whose store is suspected now."""
    probe: list[str]
    """Reported endpoints the service must probe (then MasterState.store_probe_result)."""

"""Tells the master which stores this client could not connect to (dead-store suspicion, docs/reliability.md).

A SIGKILLed store refuses connections at once, but the master only expires it after its heartbeat TTL;
meanwhile every client would keep being sent to it. A transfer that ends in CONNECTION_FAILED names the
store's data-plane endpoint here; a background thread reports it to the master (ReportStoreFailures on the
framed port), which suspects the store once a second client agrees or its own probe fails too. Reports
leave at most once per ``interval_s`` per store and never delay the caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger
from kvpool.transfer.base import TransferRequest

log = get_logger(__name__)


class StoreFailureReporter:
    """Collects failed data-plane endpoints and hands them, rate-limited, to ``send`` on its own thread."""

    def __init__(self, send: Callable[[list[str]], None], interval_s: float = 0.5) -> None:
        self._send = send
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[str] = []
        self._last_sent: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self.reported = 0
        """Endpoints reported so far (a failed report counts too)."""

    def note(self, requests: Sequence[TransferRequest], codes: Sequence[int]) -> None:
        """After a transfer: remember the endpoints whose requests failed to connect."""
        if ErrorCode.CONNECTION_FAILED not in codes:
            return
        failed = {
            r.replica.tcp_endpoint
            for r, code in zip(requests, codes, strict=True)
            if code == ErrorCode.CONNECTION_FAILED and r.replica.tcp_endpoint
        }
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            for endpoint in failed:
                if now - self._last_sent.get(endpoint, -self._interval_s) >= self._interval_s:
                    self._last_sent[endpoint] = now
                    self._pending.append(endpoint)
            if not self._pending:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-store-failures", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                endpoints, self._pending = self._pending, []
            try:
                self._send(endpoints)
            except KvPoolError as exc:
                log.debug("could not report unreachable stores %s to the master: %s", endpoints, exc)
            self.reported += len(endpoints)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(5.0)

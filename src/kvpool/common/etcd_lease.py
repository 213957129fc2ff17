"""The lease keeper: grants one etcd lease and keeps it alive from a daemon thread, reporting its loss once.

Created on an ``EtcdClient`` (``kvpool.common.etcd``), which stops it when the client closes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.log import get_logger

if TYPE_CHECKING:
    from kvpool.common.etcd import EtcdClient

log = get_logger(__name__)


class LeaseKeeper:
    """Grants a lease and keeps it alive from a daemon thread; reports its loss once through ``on_lost``.

    Renewals run every TTL/3. The keeper tracks a conservative local expiry: the time a successful renewal
    was *sent* plus the TTL the server returned (the server restarted its timer later than that). The lease
    counts as lost when that expiry passes without a renewal (etcd unreachable, or this process was frozen)
    or when the server says the lease is gone. A holder that reacts to ``on_lost`` therefore stops acting on
    the lease no later than etcd expires it, as long as this process keeps running.
    """

    def __init__(
        self,
        client: EtcdClient,
        ttl: float,
        on_lost: Callable[[], None] | None = None,
        *,
        name: str = "lease",
    ) -> None:
        self._client = client
        self._requested_ttl = ttl
        self._on_lost = on_lost
        self._name = name
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None
        self.lease_id = 0
        self.ttl = 0  # granted, whole seconds
        self._expiry = 0.0  # monotonic
        self._gone = False  # etcd said the lease no longer exists

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def expires_in(self) -> float:
        """Seconds until the local (conservative) expiry estimate."""
        return self._expiry - time.monotonic()

    def start(self) -> int:
        """Grant the lease and start renewing it; returns the lease id (KvPoolError if the grant fails)."""
        if self._thread is not None:
            raise KvPoolError(ErrorCode.INTERNAL, "LeaseKeeper.start() called twice")
        sent = time.monotonic()
        self.lease_id, self.ttl = self._client._grant(self._requested_ttl)
        self._expiry = sent + self.ttl
        self._client._adopt(self)
        self._thread = threading.Thread(target=self._run, name=f"etcd-{self._name}-{self.lease_id:x}", daemon=True)
        self._thread.start()
        return self.lease_id

    def wait_lost(self, timeout: float | None = None) -> bool:
        return self._lost.wait(timeout)

    def stop(self, revoke: bool = True, *, timeout: float | None = None) -> None:
        """Stop renewing; with ``revoke`` also revoke the lease (its keys vanish at once). Never raises."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._client.timeout + 1.0)
        # A lease lost to silence may still live on the server: revoking it frees its keys sooner.
        if revoke and self.lease_id and not self._gone:
            try:
                self._client.lease_revoke(self.lease_id, timeout=timeout)
            except KvPoolError as e:
                log.warning("could not revoke lease %x (it will expire in <= %ds): %s", self.lease_id, self.ttl, e)

    def _run(self) -> None:
        interval = self.ttl / 3.0
        retry = min(0.2, interval)
        next_renewal = time.monotonic() + interval
        while True:
            wake = min(next_renewal, self._expiry)
            if self._stop.wait(max(0.0, wake - time.monotonic())):
                return
            sent = time.monotonic()
            if sent >= self._expiry:
                self._lose(f"no successful renewal for {self.ttl}s")
                return
            try:
                # Never wait past the local expiry: the loss must be reported on time.
                left = self._client.lease_keepalive_once(self.lease_id, timeout=max(0.05, self._expiry - sent))
            except KvPoolError as e:
                log.warning("lease %x renewal failed (%.2fs left): %s", self.lease_id, self._expiry - sent, e)
                next_renewal = time.monotonic() + retry
                continue
            if self._stop.is_set():
                return
            if left <= 0:
                self._gone = True
                self._lose("etcd says the lease is gone (expired or revoked)")
                return
            self._expiry = sent + left
            next_renewal = sent + interval

    def _lose(self, why: str) -> None:
        if self._stop.is_set():
            return
        log.warning("lease %x (%s) lost: %s", self.lease_id, self._name, why)
        self._lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                log.exception("on_lost callback of lease %x failed", self.lease_id)

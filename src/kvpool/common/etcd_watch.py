"""The resumable watch: one daemon thread per watch that survives member failures and compactions.

Created by ``EtcdClient.watch`` (``kvpool.common.etcd``); it reads through the client and picks members
from the client's ``_EndpointSet``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd_types import _METADATA, EventType, KeyValue, WatchEvent, _decode_key, prefix_range_end
from kvpool.common.log import get_logger
from kvpool.proto.etcd import kv_pb2, rpc_pb2

if TYPE_CHECKING:
    from kvpool.common.etcd import EtcdClient

log = get_logger(__name__)


class _Resync(Exception):
    """The revisions the watch needs were compacted away: re-read the current state."""


class Watcher:
    """A watch that survives member failures; created by :meth:`EtcdClient.watch`.

    Events are delivered in revision order, each exactly once, from one daemon thread (keep callbacks
    short). After a stream error it resumes from the last delivered revision + 1 on any member. If that
    revision was compacted, it re-reads the current state and delivers it as synthetic events (or through
    ``on_resync(kvs, revision)`` when given; a prefix watcher that must notice keys deleted during the gap
    should use it), then continues from there.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        prefix: bool,
        start_revision: int | None,
        callback: Callable[[WatchEvent], None],
        on_resync: Callable[[list[KeyValue], int], None] | None,
    ) -> None:
        self._client = client
        self._key = key
        self._range_end = prefix_range_end(key) if prefix else b""
        self._prefix = prefix
        self._callback = callback
        self._on_resync = on_resync
        self._next_rev: int | None = start_revision if start_revision and start_revision > 0 else None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch-{_decode_key(key)}", daemon=True)
        self.member_id = 0  # etcd id of the member serving the current stream (from response headers)
        self.endpoint = ""  # address of that member
        self.streams = 0  # streams opened so far (1 + reconnects)
        self.resyncs = 0
        self._synced = threading.Event()
        self._created = False  # the current stream's watch was created

    @property
    def revision(self) -> int:
        """The last revision delivered (or read at a resync); 0 before anything."""
        return (self._next_rev or 1) - 1

    def start(self) -> None:
        self._thread.start()

    def wait_started(self, timeout: float) -> bool:
        """Wait until the first stream is established (its ``created`` answer arrived)."""
        return self._synced.wait(timeout)

    def stop(self) -> None:
        """Stop watching; no callback runs after this returns (unless called from a callback)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._cancel_stream()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._client.timeout + 2.0)

    # ---- the loop -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.05
        while not self._stopped.is_set():
            try:
                if self._next_rev is None:
                    self._resync()
                if self._stream(self._next_rev or 1):
                    backoff = 0.05
                    continue  # replaced a silent or failed stream that had worked: reconnect at once
            except _Resync:
                self.resyncs += 1
                self._next_rev = None
                continue
            except KvPoolError as e:
                log.warning("etcd watch on %r: %s", _decode_key(self._key), e)
            except Exception:
                log.exception("etcd watch on %r crashed; restarting it", _decode_key(self._key))
            if self._stopped.wait(backoff):
                return
            backoff = min(backoff * 2, 1.0)

    def _resync(self) -> None:
        kvs, revision = self._client.read(self._key, prefix=self._prefix)
        if self._stopped.is_set():
            return
        on_resync = self._on_resync
        if on_resync is not None:
            self._safe(lambda: on_resync(kvs, revision))
        else:
            for kv in kvs:
                self._deliver(WatchEvent(EventType.PUT, kv, synthetic=True))
            if not self._prefix and not kvs:
                gone = KeyValue(_decode_key(self._key), b"", 0, revision, 0, 0)
                self._deliver(WatchEvent(EventType.DELETE, gone, synthetic=True))
        self._next_rev = revision + 1

    def _stream(self, start_revision: int) -> bool:
        """Run one watch stream on one member; returns True if it was established before it ended."""
        requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        create = rpc_pb2.WatchCreateRequest(key=self._key, range_end=self._range_end, start_revision=start_revision)
        requests.put(rpc_pb2.WatchRequest(create_request=create))
        last_rx = [time.monotonic()]
        ep = self._client._members.pick()
        with self._lock:
            if self._stopped.is_set():
                return False
            self._requests = requests
            self._call = ep.watch.Watch(self._request_iter(requests, last_rx), metadata=_METADATA)
            call = self._call
        self.endpoint = ep.address
        self.streams += 1
        self._created = False
        try:
            self._consume(call, start_revision, last_rx)
            why = "stream closed by the member"
        except grpc.RpcError as e:
            why = f"stream ended: {e.code().name}"
        except KvPoolError as e:
            why = e.message
        finally:
            self._cancel_stream()
        if not self._stopped.is_set():
            log.info("etcd watch on %r: %s; resuming at revision %s", _decode_key(self._key), why, self._next_rev)
            self._client._members.failed(ep, why)
        return self._created

    def _consume(self, call: Any, start_revision: int, last_rx: list[float]) -> None:
        """Deliver the events of one stream until it ends; raises _Resync when history was compacted."""
        watch_id: int | None = None
        for resp in call:
            last_rx[0] = time.monotonic()
            self.member_id = int(resp.header.member_id)
            if resp.created and watch_id is None:
                watch_id, self._created = resp.watch_id, True
                self._synced.set()
            if resp.compact_revision > 0:
                log.warning(
                    "etcd watch on %r: revision %d compacted (oldest kept %d); re-reading",
                    _decode_key(self._key),
                    start_revision,
                    resp.compact_revision,
                )
                raise _Resync()
            if resp.watch_id != watch_id:
                continue  # a progress answer (watch_id -1) only proves the stream is alive
            if resp.canceled:
                raise KvPoolError(ErrorCode.ETCD_ERROR, f"watch canceled by etcd: {resp.cancel_reason}")
            self._deliver_events(resp.events)

    def _request_iter(
        self, requests: queue.Queue[rpc_pb2.WatchRequest | None], last_rx: list[float]
    ) -> Iterator[rpc_pb2.WatchRequest]:
        """Feeds the stream: the create request, then a progress request every liveness/2 seconds.

        It runs in gRPC's request thread and doubles as the stream's watchdog: a stream that stayed silent
        for ``watch_liveness`` seconds (a frozen member) is cancelled so that the loop reconnects elsewhere.
        """
        liveness = self._client.watch_liveness
        progress = rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())
        while True:
            try:
                item = requests.get(timeout=liveness / 2)
            except queue.Empty:
                if time.monotonic() - last_rx[0] > liveness:
                    log.warning(
                        "etcd watch on %r: member silent for %.1fs; reconnecting",
                        _decode_key(self._key),
                        liveness,
                    )
                    self._cancel_stream(requests)
                    return
                item = progress
            if item is None:
                return
            yield item

    def _cancel_stream(self, only: queue.Queue[rpc_pb2.WatchRequest | None] | None = None) -> None:
        with self._lock:
            if only is not None and only is not self._requests:
                return
            call, requests = self._call, self._requests
            self._call = self._requests = None
        if requests is not None:
            requests.put(None)  # unblocks the request iterator so gRPC's request thread can finish
        if call is not None:
            call.cancel()

    def _deliver_events(self, events: Sequence[kv_pb2.Event]) -> None:
        top = 0
        for ev in events:
            kv = KeyValue.from_pb(ev.kv)
            if self._next_rev is not None and kv.mod_revision < self._next_rev:
                continue  # already delivered before a reconnect
            kind = EventType.DELETE if ev.type == kv_pb2.Event.DELETE else EventType.PUT
            self._deliver(WatchEvent(kind, kv))
            top = max(top, kv.mod_revision)
        if top:
            # etcd sends all events of one revision in one response, so resuming at top + 1 loses nothing.
            self._next_rev = top + 1

    def _deliver(self, event: WatchEvent) -> None:
        if not self._stopped.is_set():
            self._safe(lambda: self._callback(event))

    def _safe(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:
            log.exception("etcd watch callback on %r failed", _decode_key(self._key))

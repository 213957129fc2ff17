"""KV events for routers: what the pool stores and drops, as SGLang's KV-event stream (medium ``EXTERNAL``).

``kvpool master --kv-events tcp://*:5557`` binds a ZMQ PUB socket and publishes, in SGLang's wire format
(``sglang/srt/disaggregation/kv_events.py``: multipart ``[topic, seq (8 bytes big-endian), msgpack
EventBatch]``, an ``EventBatch`` being the array ``[ts, events, attn_dp_rank]`` and each event a map tagged
by ``type``), ``BlockStored`` when a page becomes readable in the pool, ``BlockRemoved`` when it is removed
or evicted, and ``AllBlocksCleared`` when the stream lost events (see below), so that an event-driven
router (SGLang Model Gateway's ``cache_aware`` policy) can count pool hits.

Which objects are pages: kvpool's page keys (:class:`kvpool.common.keys.Namespace`) end in
``<page hash>_<rank...>_k``; one object per page stands for it (TP rank 0, PP rank 0; MLA's single copy),
so a page gives one event, not one per rank and K/V half. vLLM connector pages are the markers
``..._<block hash>_ok``. The block hash of an event is SGLang's ``hash_str_to_int64`` of the page hash (its
first 16 hex digits as a signed 64-bit integer), what SGLang's own events carry for the same page.
Other keys give no event.

A slow or absent subscriber never slows the master: the master's calls only append the keys to a
bounded queue (no I/O, no encoding); a publisher thread drains it, builds batches and sends them
without blocking (ZMQ drops for a subscriber past its high-water mark). When the queue is full the keys
are dropped and counted; the next batch then starts with ``AllBlocksCleared``, so that a router forgets
what it can no longer trust instead of routing to pages it was never told were evicted.

Needs pyzmq and msgspec (``pip install kvpool[kv-events]``), imported only when the option is used.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.common.log import get_logger

log = get_logger(__name__)

MEDIUM = "EXTERNAL"
_HEX = frozenset("0123456789abcdefABCDEF")


def hash_str_to_int64(page_hash: str) -> int:
    """SGLang's event hash of a page: the first 16 hex digits as a signed 64-bit integer."""
    value = int(page_hash[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def page_hash_of(key: str) -> str | None:
    """The page hash when ``key`` is the object that stands for a page, else None."""
    if key.endswith("_ok"):  # vLLM connector marker: <namespace>_<block hash>_ok
        candidate = key[: -len("_ok")].rsplit("_", 1)[-1]
        return candidate if _is_hash(candidate) else None
    if not key.endswith("_k"):
        return None
    parts = key[: -len("_k")].split("_")
    ranks: list[str] = []
    while parts and len(ranks) < 2 and (parts[-1] == "" or parts[-1].isdigit()) and not _is_hash(parts[-1]):
        ranks.append(parts.pop())
    if not parts or not ranks or any(r not in ("", "0") for r in ranks):
        return None
    return parts[-1] if _is_hash(parts[-1]) else None


def _is_hash(part: str) -> bool:
    return len(part) >= 16 and all(c in _HEX for c in part)


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str
    """ZMQ endpoint to bind, e.g. ``tcp://*:5557``."""
    queue_calls: int = 65536
    """Master calls waiting for the publisher (a put_end batch, or one removed or evicted object each);
    past it keys are dropped."""
    batch_events: int = 1024
    """Most page events in one published batch."""
    flush_s: float = 0.05
    """A batch is sent at the latest this long after its first event."""
    page_size: int = 0
    """``block_size`` written into BlockStored (the engines' page size; 0 = unknown)."""
    topic: str = ""
    """ZMQ topic frame (SGLang's default is empty)."""


class KvEventPublisher:
    """The bounded queue the master feeds and the thread that publishes it (see the module docstring)."""

    def __init__(self, config: KvEventsConfig) -> None:
        import msgspec
        import zmq

        self.config = config
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: Any = zmq.Context.instance()
        self._zmq = zmq
        self._queue: queue.Queue[tuple[Sequence[str], Sequence[str]]] = queue.Queue(maxsize=config.queue_calls)
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: Any = None
        self._seq = 0
        self.dropped_keys = 0
        self.published_events = 0
        self.published_batches = 0
        self.bound_endpoint = ""

    # --- master side: never blocks ---------------------------------------------------------------

    def record(self, stored: Sequence[str], removed: Sequence[str]) -> None:
        """Called by the master with keys that became readable / were removed. O(1), never blocks."""
        if not stored and not removed:
            return
        try:
            self._queue.put_nowait((stored, removed))
        except queue.Full:
            self.dropped_keys += len(stored) + len(removed)
            self._lost.set()

    # --- publisher thread --------------------------------------------------------------------------

    def start(self) -> KvEventPublisher:
        sock = self._ctx.socket(self._zmq.PUB)
        sock.setsockopt(self._zmq.SNDHWM, 100_000)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.bind(self.config.endpoint)
        self.bound_endpoint = str(sock.getsockopt(self._zmq.LAST_ENDPOINT).decode())
        self._socket = sock
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("kv events: publishing on %s", self.bound_endpoint)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    def _run(self) -> None:
        while not self._stop.is_set():
            events = self._collect()
            if events:
                self._send(events)

    def _collect(self) -> list[dict[str, Any]]:
        """Up to ``batch_events`` page events, waiting at most ``flush_s`` after the first one."""
        stored: list[int] = []
        removed: list[int] = []
        events: list[dict[str, Any]] = []
        if self._lost.is_set():
            self._lost.clear()
            events.append({"type": "AllBlocksCleared"})
        deadline: float | None = None
        while len(stored) + len(removed) < self.config.batch_events:
            timeout = self.config.flush_s if deadline is None else deadline - time.monotonic()
            if timeout <= 0:
                break
            try:
                keys_stored, keys_removed = self._queue.get(timeout=timeout)
            except queue.Empty:
                break
            if deadline is None:
                deadline = time.monotonic() + self.config.flush_s
            if keys_removed and stored:  # keep the order: a page stored then removed ends removed
                events.append(self._stored(stored))
                stored = []
            if keys_stored and removed:
                events.append(self._removed(removed))
                removed = []
            stored.extend(h for h in _hashes(keys_stored))
            removed.extend(h for h in _hashes(keys_removed))
        if stored:
            events.append(self._stored(stored))
        if removed:
            events.append(self._removed(removed))
        return events

    def _stored(self, hashes: list[int]) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": self.config.page_size,
            "lora_id": None,
            "medium": MEDIUM,
        }

    @staticmethod
    def _removed(hashes: list[int]) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = self._encoder.encode([time.time(), events, None])
        frames = (self.config.topic.encode(), self._seq.to_bytes(8, "big"), payload)
        try:
            self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:  # no room: the events are lost for the subscribers
            self._lost.set()
            return
        except Exception as exc:
            log.warning("kv events: send failed: %s", exc)
            self._lost.set()
            return
        self._seq += 1
        self.published_batches += 1
        self.published_events += sum(len(e.get("block_hashes", ())) for e in events)


def _hashes(keys: Sequence[str]) -> list[int]:
    out: list[int] = []
    for key in keys:
        page = page_hash_of(key)
        if page is not None:
            out.append(hash_str_to_int64(page))
    return out

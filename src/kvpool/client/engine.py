"""EngineClient: the prefix API an inference engine calls (docs/architecture.md, Client; docs/sglang.md).

* ``prefix_length(tokens)``: how many leading pages of a prompt the pool holds - one master round trip
  for the whole prompt, bounded by a short deadline (0 when the master is unreachable).
* ``prefetch(keys, into, deadline_s, policy) -> PrefetchHandle``: returns at once; the client's own I/O
  threads fetch the pages in prefix order, in chunks, so whatever has arrived is always a prefix.
* ``write_back(keys, buffers) -> bool``: an asynchronous put with bounded memory; when the queue is full
  the write-back is dropped (and counted), never stalled.

The engine's thread never blocks on the network: everything but ``prefix_length`` runs on the I/O threads.

**Pages and objects.** A page is ``page_size`` tokens. Its key is the SGLang page hash
(:func:`kvpool.common.keys.page_keys`); the :class:`~kvpool.common.keys.Namespace` turns it into one object
(MLA) or two (MHA: ``_k`` and ``_v``). Buffers are given per *object*, in page order:
``[page0_k, page0_v, page1_k, ...]`` for MHA - the order of SGLang's ``get_page_buffer_meta``.

**Cancel safety.** Transports write into their destination from their own threads and a ``recv_into``
cannot be interrupted half-way, so a prefetch never lets a transport touch the caller's memory: pages land
in a per-thread staging buffer and are copied into the caller's buffers under the handle's lock, one page
at a time. ``cancel()`` takes the same lock, so once it returns no byte is written into the caller's
buffers any more (SGLang #31296 was a segfault from a transfer writing into freed host slots). The price
is one memcpy per page, paid on the I/O thread.

**Degraded mode.** A dead master makes the lookups return 0 at once (the PoolClient's circuit breaker
fails fast and probes in the background of later calls); a page whose read fails (dead store, stale
index entry) goes into a short negative cache so that the next lookups stop before it instead of
promising a hit that times out again (the "stale-hit storm" of SGLang #31315).
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.client.pool_client import Buffer, PoolClient, ptr_view
from kvpool.common.errors import ErrorCode, KvPoolError, strerror
from kvpool.common.keys import Namespace
from kvpool.common.keys import page_keys as _chain_keys
from kvpool.common.log import get_logger
from kvpool.common.registry import Registry
from kvpool.transfer.memcopy import copy_into, copy_of, page_aligned

log = get_logger(__name__)

PageBytes = int | Callable[[str], int]
"""Size of one object: a constant, or a function of the object key (layouts whose k and v differ)."""

Into = Sequence[Buffer] | tuple[Sequence[int], Sequence[int]]
"""Prefetch destinations: one buffer per object, or ``(ptrs, sizes)`` of raw host memory."""

MiB = 1 << 20
_MIN_CALL_S = 0.001  # a network call with less budget than this cannot succeed: it is not started

# Read failures that say "this page cannot be read from where the index says it is" (stale entry, dead
# store, corrupt copy): worth remembering. A TIMEOUT (our own deadline), an unreachable master or a lease
# that ran out says nothing about the page, so it must not hide the page from the next lookups.
_UNREADABLE = frozenset(
    {
        ErrorCode.OBJECT_NOT_FOUND,
        ErrorCode.CONNECTION_FAILED,
        ErrorCode.TRANSFER_FAILED,
        ErrorCode.CHECKSUM_MISMATCH,
        ErrorCode.OUT_OF_BOUNDS,
        ErrorCode.SEGMENT_NOT_FOUND,
        ErrorCode.STORE_NOT_FOUND,
        ErrorCode.BUFFER_TOO_SMALL,
    }
)


class PrefetchPolicy(enum.StrEnum):
    """SGLang's ``--hicache-storage-prefetch-policy`` semantics, as seen by the caller of ``wait()``."""

    BEST_EFFORT = "best_effort"
    """``wait()`` does not block: it stops the prefetch and returns what has arrived."""
    WAIT_COMPLETE = "wait_complete"
    """``wait()`` blocks until every hit page has arrived; ``deadline_s`` bounds each network call
    (so a dead peer ends the prefetch), not the prefetch as a whole."""
    TIMEOUT = "timeout"
    """The prefetch stops at ``deadline_s`` after it was issued; ``wait()`` blocks until then at most."""


# The one list of prefetch policies (common/registry.py): ``EngineClient.prefetch`` accepts these names, and
# a new policy is a member above, its branch in ``PrefetchHandle``, and its line here.
PREFETCH_POLICIES: Registry[PrefetchPolicy] = Registry("prefetch policy")
for _policy in PrefetchPolicy:
    PREFETCH_POLICIES.add(_policy.value, _policy)


class EndReason(enum.StrEnum):
    COMPLETE = "complete"  # every hit page arrived
    MISS = "miss"  # nothing to fetch (no hit, or the lookup failed)
    FAILED = "failed"  # a read failed: the pages before it are kept
    DEADLINE = "deadline"  # the timeout policy's deadline passed
    COLLECTED = "collected"  # best_effort wait(): the caller took what had arrived
    CANCELLED = "cancelled"
    CLOSED = "closed"  # the EngineClient was closed
    INVALID = "invalid"  # the destinations do not fit the pages


class PrefetchHandle:
    """The caller's view of one prefetch. Thread-safe; every method returns without network waits
    (``wait`` blocks at most until its timeout or the policy's end)."""

    def __init__(self, pages: int, policy: PrefetchPolicy, deadline_s: float, on_wait: Callable[[float], None]) -> None:
        self.pages = pages
        self.policy = policy
        self.deadline_s = deadline_s
        self.issued_at = time.monotonic()
        self._deadline_at = self.issued_at + deadline_s
        self._on_wait = on_wait
        self._cond = threading.Condition()
        # Read without the lock by the getters (an int/bool read is atomic); written under it.
        self._completed = 0
        self._hit: int | None = None
        self._open = True  # True while the I/O thread may still write into the caller's buffers
        self._reason: EndReason | None = None
        self.finished_at: float | None = None

    # --- caller side -----------------------------------------------------------------------------

    def done(self) -> bool:
        """True once no more pages will arrive (and none will be written into the buffers)."""
        return not self._open

    def completed_pages(self) -> int:
        """Leading pages already in the caller's buffers, usable now."""
        return self._completed

    def hit_pages(self) -> int | None:
        """Pages the pool said it holds (None until the lookup is done)."""
        return self._hit

    @property
    def end_reason(self) -> EndReason | None:
        return self._reason

    def wait(self, timeout: float | None = None) -> int:
        """Apply the policy (see :class:`PrefetchPolicy`) and return the completed pages.

        If ``timeout`` runs out first, the prefetch goes on (``done()`` stays False) and the count
        may still grow: use the buffers only after ``done()`` or ``cancel()``.
        """
        start = time.monotonic()
        with self._cond:
            if self.policy is PrefetchPolicy.BEST_EFFORT:
                self._end_locked(EndReason.COLLECTED)
            else:
                self._wait_locked(start, timeout)
            completed = self._completed
        self._on_wait(time.monotonic() - start)
        return completed

    def _wait_locked(self, start: float, timeout: float | None) -> None:
        until = float("inf") if timeout is None else start + timeout
        policy_end = self._deadline_at if self.policy is PrefetchPolicy.TIMEOUT else float("inf")
        while self._open:
            now = time.monotonic()
            if now >= policy_end:
                # Do not rely on the I/O thread to notice: it may sit in a network call until its
                # own deadline. Ending here makes the answer exact now.
                self._end_locked(EndReason.DEADLINE)
                break
            end = min(until, policy_end)
            if end == float("inf"):
                self._cond.wait()
                continue
            if end <= now:
                break
            self._cond.wait(end - now)

    def cancel(self) -> int:
        """Stop the prefetch; after this returns no byte is written into the caller's buffers.
        Returns the pages completed (a prefix, final)."""
        with self._cond:
            self._end_locked(EndReason.CANCELLED)
            return self._completed

    # --- I/O-thread side ---------------------------------------------------------------------------

    def _end_locked(self, reason: EndReason) -> None:
        if self._open:
            self._open = False
            self._reason = reason
            self.finished_at = time.monotonic()
            self._cond.notify_all()

    def _end(self, reason: EndReason) -> None:
        with self._cond:
            self._end_locked(reason)

    def _set_hit(self, hit: int) -> None:
        with self._cond:
            self._hit = hit
            if hit == 0:
                self._end_locked(EndReason.MISS)

    def _deliver(
        self, first_page: int, dests: list[memoryview], staged: list[memoryview], per_page: int, pages: int
    ) -> int:
        """Copy up to ``pages`` staged pages into the caller's buffers (none once the handle is
        closed); returns how many were copied.

        One page per lock hold: ``cancel()`` and ``wait()`` never wait behind more than one page copy.
        """
        for p in range(pages):
            with self._cond:
                if not self._open:
                    return p
                if self._completed != first_page + p:
                    raise KvPoolError(ErrorCode.INTERNAL, "prefetch pages delivered out of order")
                for j in range(p * per_page, (p + 1) * per_page):
                    copy_into(dests[j], staged[j])
                self._completed += 1
                if self._hit is not None and self._completed >= self._hit:
                    self._end_locked(EndReason.COMPLETE)
                self._cond.notify_all()
        return pages

    def _policy_deadline(self) -> float | None:
        """Absolute end of the whole prefetch (None: wait_complete, bounded per call instead)."""
        return None if self.policy is PrefetchPolicy.WAIT_COMPLETE else self._deadline_at

    def __repr__(self) -> str:
        return (
            f"PrefetchHandle(pages={self.pages}, hit={self._hit}, completed={self._completed}, "
            f"policy={self.policy.value}, open={self._open}, reason={self._reason})"
        )


# ------------------------------------------------------------------------------------------- tasks
@dataclass
class _PrefetchTask:
    handle: PrefetchHandle
    hashes: list[str]
    into: Into
    hit_pages: int | None


@dataclass
class _WriteBackTask:
    hashes: list[str]
    buffers: list[memoryview]
    nbytes: int
    on_done: Callable[[bool], object] | None
    queued_at: float = field(default_factory=time.monotonic)


class _Metrics:
    """Counters (and two gauges) for ``EngineClient.metrics()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = dict.fromkeys(
            (
                "lookups",
                "lookup_pages",
                "lookup_hit_pages",
                "lookup_seconds",
                "prefetch_requests",
                "prefetch_pages",
                "prefetch_bytes",
                "prefetch_seconds",
                "prefetch_hit_pages",
                "prefetch_wait_seconds",
                "prefetch_cancelled",
                "prefetch_deadline",
                "prefetch_failed",
                "prefetch_collected",
                "writeback_queued",
                "writeback_queued_bytes",
                "writeback_dropped",
                "writeback_dropped_bytes",
                "writeback_done",
                "writeback_failed",
                "writeback_bytes",
                "writeback_seconds",
                "negative_cache_hits",
            ),
            0.0,
        )

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self.values[name] += delta

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)


class _NegativeCache:
    """Pages whose read failed recently: lookups stop before them until the entry expires."""

    def __init__(self, ttl_s: float, max_entries: int = 65536) -> None:
        self._ttl = ttl_s
        self._max = max_entries
        self._lock = threading.Lock()
        self._until: OrderedDict[str, float] = OrderedDict()

    def add(self, page_hash: str) -> None:
        if self._ttl <= 0:
            return
        with self._lock:
            self._until[page_hash] = time.monotonic() + self._ttl
            self._until.move_to_end(page_hash)
            while len(self._until) > self._max:
                self._until.popitem(last=False)

    def truncate(self, hashes: Sequence[str], pages: int) -> int:
        """``pages`` cut at the first page still in the cache."""
        if not self._until:  # the common case: no failures, no lock
            return pages
        now = time.monotonic()
        with self._lock:
            for i in range(pages):
                until = self._until.get(hashes[i])
                if until is None:
                    continue
                if until > now:
                    return i
                del self._until[hashes[i]]
        return pages


def _byte_view(buf: Buffer, writable: bool) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "prefetch destination is read-only")
    return view


def _is_ptr_form(into: Into) -> bool:
    return (
        isinstance(into, tuple)
        and len(into) == 2
        and isinstance(into[0], (list, tuple))
        and all(isinstance(p, int) for p in into[0][:1])
    )


class EngineClient:
    """Prefix lookups, asynchronous prefetch and write-back for one model deployment (one namespace).

    ``pool`` is shared and not owned: ``close()`` leaves it open.
    """

    def __init__(
        self,
        pool: PoolClient,
        namespace: Namespace,
        page_size: int,
        page_bytes: PageBytes,
        max_writeback_bytes: int = 256 * MiB,
        io_threads: int = 2,
        *,
        lookup_timeout_s: float = 0.25,
        writeback_timeout_s: float = 10.0,
        chunk_bytes: int = 4 * MiB,
        negative_ttl_s: float = 2.0,
    ) -> None:
        if page_size <= 0 or io_threads < 1 or max_writeback_bytes < 0 or chunk_bytes <= 0:
            raise ValueError("need page_size > 0, io_threads >= 1, max_writeback_bytes >= 0, chunk_bytes > 0")
        self.pool = pool
        self.namespace = namespace
        self.page_size = page_size
        self._page_bytes = page_bytes
        self.max_writeback_bytes = max_writeback_bytes
        self.lookup_timeout_s = lookup_timeout_s
        self.writeback_timeout_s = writeback_timeout_s
        self.chunk_bytes = chunk_bytes
        self.objects_per_page = len(namespace.object_keys("0" * 64))
        self._metrics = _Metrics()
        self._negative = _NegativeCache(negative_ttl_s)
        self._local = threading.local()  # per-thread staging buffer
        self._cond = threading.Condition()
        self._prefetch_q: deque[_PrefetchTask] = deque()
        self._writeback_q: deque[_WriteBackTask] = deque()
        self._open_handles: set[PrefetchHandle] = set()
        self._wb_bytes = 0  # queued + in flight: what max_writeback_bytes bounds
        self._wb_active = 0
        # Reads are latency-critical: with 2+ threads, write-backs never occupy the last one, so a
        # prefetch never queues behind a long put.
        self._max_writers = max(1, io_threads - 1)
        self._closed = False
        self._stopping = False
        self._last_writeback_error = ""  # for diagnosis: the codes of the latest failed write-back
        self._threads = [
            threading.Thread(target=self._worker, name=f"kvpool-engine-io-{i}", daemon=True) for i in range(io_threads)
        ]
        for thread in self._threads:
            thread.start()

    # --- keys ------------------------------------------------------------------------------------

    def page_keys(self, tokens: Sequence[int], prior: str | None = None) -> list[str]:
        """SGLang page hashes of the FULL pages of ``tokens`` (a partial tail page is never reused by an
        engine - it is recomputed - so it gets no key)."""
        full = len(tokens) - len(tokens) % self.page_size
        return _chain_keys(tokens[:full], self.page_size, prior)

    def object_keys(self, page_hashes: Sequence[str]) -> list[str]:
        """The pool keys of the pages' objects, in buffer order (k, v per page for MHA)."""
        ns = self.namespace
        return [key for h in page_hashes for key in ns.object_keys(h)]

    def page_bytes(self, object_key: str) -> int:
        pb = self._page_bytes
        return pb if isinstance(pb, int) else int(pb(object_key))

    def _as_hashes(self, tokens_or_keys: Sequence[int] | Sequence[str]) -> list[str]:
        if not tokens_or_keys:
            return []
        if isinstance(tokens_or_keys[0], str):
            return [str(k) for k in tokens_or_keys]
        return self.page_keys([int(t) for t in tokens_or_keys])

    # --- lookups -----------------------------------------------------------------------------------

    def prefix_length(self, tokens_or_keys: Sequence[int] | Sequence[str], timeout: float | None = None) -> int:
        """Leading pages the pool holds (all objects of each page); one master round trip.

        Synchronous by nature, bounded by ``timeout`` (default ``lookup_timeout_s``); 0 when degraded.
        """
        hashes = self._as_hashes(tokens_or_keys)
        if not hashes:
            return 0
        return self._lookup(hashes, self.lookup_timeout_s if timeout is None else timeout)

    def _lookup(self, hashes: list[str], timeout: float) -> int:
        start = time.monotonic()
        objects = self.pool.prefix_length(self.object_keys(hashes), timeout=max(timeout, 0.001))
        found = objects // self.objects_per_page
        pages = self._negative.truncate(hashes, found)
        self._metrics.add(
            lookups=1,
            lookup_pages=len(hashes),
            lookup_hit_pages=pages,
            lookup_seconds=time.monotonic() - start,
            negative_cache_hits=int(pages < found),
        )
        return pages

    # --- prefetch --------------------------------------------------------------------------------

    def prefetch(
        self,
        keys: Sequence[str],
        into: Into,
        deadline_s: float = 1.0,
        policy: PrefetchPolicy | str = PrefetchPolicy.BEST_EFFORT,
        *,
        hit_pages: int | None = None,
    ) -> PrefetchHandle:
        """Start fetching the pages ``keys`` (page hashes) into ``into``; returns at once.

        ``into``: one writable buffer per object (``len(keys) * objects_per_page``, each exactly the
        object's size), or ``(ptrs, sizes)`` of raw host memory in the same order. The buffers must stay
        valid until the handle is ``done()`` (or ``cancel()`` returned). ``hit_pages``: the caller already
        ran ``prefix_length`` - skip the lookup round trip.
        """
        policy = PREFETCH_POLICIES.get(policy)
        hashes = list(keys)
        expected = len(hashes) * self.objects_per_page
        n_into = len(into[0]) if _is_ptr_form(into) else len(into)
        if n_into != expected:
            raise KvPoolError(
                ErrorCode.INVALID_ARGUMENT, f"{len(hashes)} pages need {expected} destinations, got {n_into}"
            )
        handle = PrefetchHandle(len(hashes), policy, deadline_s, self._on_wait)
        self._metrics.add(prefetch_requests=1)
        if not hashes or hit_pages == 0:
            handle._set_hit(0)
            return handle
        with self._cond:
            if self._closed:
                handle._end(EndReason.CLOSED)
                return handle
            self._open_handles.add(handle)
            self._prefetch_q.append(_PrefetchTask(handle, hashes, into, hit_pages))
            self._cond.notify()
        return handle

    def _on_wait(self, seconds: float) -> None:
        self._metrics.add(prefetch_wait_seconds=seconds)

    def _run_prefetch(self, task: _PrefetchTask) -> None:
        handle = task.handle
        start = time.monotonic()
        fetched_bytes = 0
        try:
            if not handle.done():
                hit = self._prefetch_hit(task)
                handle._set_hit(hit)
                if hit:
                    fetched_bytes = self._fetch_pages(task, hit)
                handle._end(EndReason.COMPLETE)  # no-op when something ended it already
        except KvPoolError as exc:
            log.error("prefetch stopped: %s", exc)
            handle._end(EndReason.INVALID if exc.code == ErrorCode.INVALID_ARGUMENT else EndReason.FAILED)
        except Exception:  # an I/O thread must survive anything one prefetch throws
            log.exception("prefetch failed")
        finally:
            handle._end(EndReason.FAILED)  # an unexpected exception must not leave the handle open
            with self._cond:
                self._open_handles.discard(handle)
            self._count_prefetch(handle, fetched_bytes, time.monotonic() - start)

    def _count_prefetch(self, handle: PrefetchHandle, nbytes: int, seconds: float) -> None:
        reason = handle.end_reason
        self._metrics.add(
            prefetch_pages=handle.completed_pages(),
            prefetch_bytes=nbytes,
            prefetch_seconds=seconds,
            prefetch_hit_pages=handle.hit_pages() or 0,
            prefetch_cancelled=int(reason is EndReason.CANCELLED),
            prefetch_deadline=int(reason is EndReason.DEADLINE),
            prefetch_failed=int(reason is EndReason.FAILED),
            prefetch_collected=int(reason is EndReason.COLLECTED),
        )

    def _prefetch_hit(self, task: _PrefetchTask) -> int:
        if task.hit_pages is not None:
            return self._negative.truncate(task.hashes, min(task.hit_pages, len(task.hashes)))
        timeout = self._call_timeout(task.handle, cap=self.lookup_timeout_s)
        if timeout < _MIN_CALL_S:
            task.handle._end(EndReason.DEADLINE)
            return 0
        return self._lookup(task.hashes, timeout)

    def _call_timeout(self, handle: PrefetchHandle, cap: float | None = None) -> float:
        """Deadline of the next network call of a prefetch: what is left of the policy's deadline, or
        ``deadline_s`` per call under wait_complete."""
        end = handle._policy_deadline()
        timeout = handle.deadline_s if end is None else end - time.monotonic()
        return timeout if cap is None else min(timeout, cap)

    def _fetch_pages(self, task: _PrefetchTask, hit: int) -> int:
        """Fetch pages [0, hit) chunk by chunk, in order; stop at the first failed page. Returns bytes."""
        handle, per_page = task.handle, self.objects_per_page
        page_nbytes = sum(self._dest_sizes(task, 0, 1))
        chunk_pages = max(1, self.chunk_bytes // max(1, page_nbytes))
        fetched = 0
        for first in range(0, hit, chunk_pages):
            if handle.done():
                break
            timeout = self._call_timeout(handle)
            if timeout < _MIN_CALL_S:  # too little left for a round trip: do not start one
                handle._end(EndReason.DEADLINE)
                break
            pages = min(chunk_pages, hit - first)
            keys = self.object_keys(task.hashes[first : first + pages])
            sizes = self._dest_sizes(task, first, pages)
            self._check_sizes(keys, sizes)
            staged = self._staging(sizes)
            codes = self.pool.batch_get_into(keys, staged, timeout=timeout)
            good = _leading_good_pages(codes, sizes, per_page)
            if good < pages and _unreadable(codes[good * per_page : (good + 1) * per_page]):
                self._negative.add(task.hashes[first + good])
            dests = self._dest_views(task, first, pages)
            delivered = handle._deliver(first, dests, staged, per_page, good)
            fetched += sum(sizes[: delivered * per_page])
            if good < pages:
                handle._end(_failure_reason(handle))
            if handle.done():
                break
        return fetched

    def _dest_sizes(self, task: _PrefetchTask, first_page: int, pages: int) -> list[int]:
        lo, hi = first_page * self.objects_per_page, (first_page + pages) * self.objects_per_page
        if _is_ptr_form(task.into):
            return [int(s) for s in task.into[1][lo:hi]]
        return [_byte_view(b, writable=False).nbytes for b in task.into[lo:hi]]

    def _dest_views(self, task: _PrefetchTask, first_page: int, pages: int) -> list[memoryview]:
        # Built on the I/O thread: a ctypes view per pointer costs microseconds, too much for the
        # engine's thread on a long prompt.
        lo, hi = first_page * self.objects_per_page, (first_page + pages) * self.objects_per_page
        if _is_ptr_form(task.into):
            ptrs, sizes = task.into
            return [ptr_view(int(p), int(s)) for p, s in zip(ptrs[lo:hi], sizes[lo:hi], strict=True)]
        return [_byte_view(b, writable=True) for b in task.into[lo:hi]]

    def _check_sizes(self, keys: list[str], sizes: list[int]) -> None:
        for key, size in zip(keys, sizes, strict=True):
            want = self.page_bytes(key)
            if size != want:
                raise KvPoolError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"destination of {key} holds {size} bytes, a page object is {want}",
                )

    def _staging(self, sizes: list[int]) -> list[memoryview]:
        """Views over this thread's staging buffer (grown on demand, reused across chunks)."""
        total = sum(sizes)
        view: memoryview | None = getattr(self._local, "staging", None)
        if view is None or len(view) < total:
            view = page_aligned(total)
            self._local.staging = view
        out, offset = [], 0
        for size in sizes:
            out.append(view[offset : offset + size])
            offset += size
        return out

    # --- write-back ------------------------------------------------------------------------------

    def write_back(
        self,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        *,
        copy: bool = True,
        on_done: Callable[[bool], object] | None = None,
    ) -> bool:
        """Queue an asynchronous put of the pages ``keys`` (one buffer per object, as for prefetch).

        Returns False - the write-back is DROPPED and counted - when it would take the queue past
        ``max_writeback_bytes``: losing a cache write costs a later recompute, stalling the engine costs
        now. ``copy=True`` snapshots the buffers (a memcpy on this thread) so the caller may reuse them
        at once; with ``copy=False`` they must stay unchanged until ``on_done`` runs (or ``flush``).
        ``on_done(ok)`` runs on an I/O thread.
        """
        hashes = list(keys)
        if len(buffers) != len(hashes) * self.objects_per_page:
            raise KvPoolError(
                ErrorCode.INVALID_ARGUMENT,
                f"{len(hashes)} pages need {len(hashes) * self.objects_per_page} buffers, got {len(buffers)}",
            )
        views = [_byte_view(b, writable=False) for b in buffers]
        nbytes = sum(v.nbytes for v in views)
        with self._cond:
            if self._closed or self._wb_bytes + nbytes > self.max_writeback_bytes:
                self._metrics.add(writeback_dropped=1, writeback_dropped_bytes=nbytes)
                return False
            self._wb_bytes += nbytes  # reserve before copying: the bound holds while we copy
        if copy:
            views = [copy_of(v) for v in views]
        with self._cond:
            self._writeback_q.append(_WriteBackTask(hashes, views, nbytes, on_done))
            self._cond.notify()
        self._metrics.add(writeback_queued=1, writeback_queued_bytes=nbytes)
        return True

    def _run_write_back(self, task: _WriteBackTask) -> None:
        start = time.monotonic()
        keys = self.object_keys(task.hashes)
        ok = True
        per_chunk = max(1, self.chunk_bytes // max(1, task.buffers[0].nbytes)) if task.buffers else 1
        for lo in range(0, len(keys), per_chunk):
            codes = self.pool.batch_put_from(
                keys[lo : lo + per_chunk], task.buffers[lo : lo + per_chunk], timeout=self.writeback_timeout_s
            )
            if any(c != 0 for c in codes):
                ok = False
                self._last_writeback_error = ", ".join(sorted({strerror(c) for c in codes if c != 0}))
                log.debug("write-back of %d objects failed: %s", len(codes), self._last_writeback_error)
                break  # the master or a store is in trouble: do not push the rest into it
        self._metrics.add(
            writeback_done=int(ok),
            writeback_failed=int(not ok),
            writeback_bytes=task.nbytes if ok else 0,
            writeback_seconds=time.monotonic() - start,
        )
        if task.on_done is not None:
            try:
                task.on_done(ok)
            except Exception:
                log.exception("write-back on_done callback failed")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-back has finished; False if ``timeout`` ran out first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._writeback_q or self._wb_active:
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    # --- I/O threads -----------------------------------------------------------------------------

    def _next_task(self) -> _PrefetchTask | _WriteBackTask | None:
        with self._cond:
            while True:
                if self._prefetch_q:
                    return self._prefetch_q.popleft()
                if self._writeback_q and self._wb_active < self._max_writers:
                    self._wb_active += 1
                    return self._writeback_q.popleft()
                if self._stopping:
                    return None
                self._cond.wait()

    def _worker(self) -> None:
        while (task := self._next_task()) is not None:
            if isinstance(task, _PrefetchTask):
                self._run_prefetch(task)
                continue
            try:
                self._run_write_back(task)
            except Exception:
                log.exception("write-back failed")
                self._metrics.add(writeback_failed=1)
            finally:
                with self._cond:
                    self._wb_active -= 1
                    self._wb_bytes -= task.nbytes
                    self._cond.notify_all()

    # --- metrics and shutdown --------------------------------------------------------------------

    @property
    def last_writeback_error(self) -> str:
        """The error codes of the latest failed write-back ("" if none failed)."""
        return self._last_writeback_error

    def metrics(self) -> dict[str, float]:
        """Counters for the engine to publish. ``hidden_fraction`` = 1 - caller wait / fetch time: the
        share of the prefetch time that the engine did not spend blocked in ``wait()``."""
        values = self._metrics.snapshot()
        with self._cond:
            values["writeback_queue_bytes"] = float(self._wb_bytes)
            values["prefetch_in_flight"] = float(len(self._open_handles))
        fetch = values["prefetch_seconds"]
        values["hidden_fraction"] = max(0.0, 1.0 - values["prefetch_wait_seconds"] / fetch) if fetch else 1.0
        values.update({f"pool_{k}": float(v) for k, v in self.pool.metrics().items()})
        return values

    def close(self, timeout: float = 5.0) -> None:
        """Stop: open prefetches end (no more writes into their buffers), queued write-backs get
        ``timeout`` to finish, then the rest are dropped. The pool stays open (it is not ours)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            handles = list(self._open_handles)
            self._prefetch_q.clear()
        for handle in handles:
            handle._end(EndReason.CLOSED)
        if not self.flush(timeout):
            with self._cond:
                dropped = list(self._writeback_q)
                self._writeback_q.clear()
                for task in dropped:
                    self._wb_bytes -= task.nbytes
            self._metrics.add(writeback_dropped=len(dropped), writeback_dropped_bytes=sum(t.nbytes for t in dropped))
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leading_good_pages(codes: Sequence[int], sizes: Sequence[int], per_page: int) -> int:
    """Leading pages all of whose objects were read whole (bytes read == the destination's size)."""
    good = 0
    for lo in range(0, len(codes), per_page):
        if any(codes[j] != sizes[j] for j in range(lo, lo + per_page)):
            break
        good += 1
    return good


def _unreadable(codes: Sequence[int]) -> bool:
    return any(c < 0 and c in _UNREADABLE for c in codes)


def _failure_reason(handle: PrefetchHandle) -> EndReason:
    """A read cut short at the prefetch's own deadline ended it by DEADLINE, not by a failure (the code
    may be TIMEOUT or, when the deadline hit the master call, UNAVAILABLE)."""
    end = handle._policy_deadline()
    if end is not None and time.monotonic() >= end - _MIN_CALL_S:
        return EndReason.DEADLINE
    return EndReason.FAILED

"""LMCache multi-process mode's L2 storage: ``KvPoolL2Client``, a ``native_plugin`` connector client.

LMCache 0.5.6's ``native_plugin`` L2 adapter (``lmcache/v1/distributed/l2_adapters/native_plugin_l2_adapter.py``)
imports ``module_path``, builds ``class_name(**adapter_params)`` and wraps it in its
``NativeConnectorL2Adapter``, which only calls these methods (they are checked by name, not by type, so
a Python class serves as well as a pybind-wrapped C++ one)::

    event_fd() -> int                              readable when completions are waiting
    submit_batch_get(keys, memoryviews) -> int     a future id; reads into the views
    submit_batch_set(keys, memoryviews) -> int     writes from the views
    submit_batch_exists(keys) -> int
    submit_batch_delete(keys) -> int               optional (L2 eviction)
    drain_completions() -> [(future_id, ok, error, per-key bools or None)]
    close()

Configuration (LMCache's L2 adapter JSON)::

    {"type": "native_plugin", "module_path": "kvpool.client.connectors.lmcache_native",
     "class_name": "KvPoolL2Client", "adapter_params": {"master": "10.0.0.1:50051"}}

``adapter_params`` are the common connector keys of :mod:`kvpool.client.connectors.base` (``master``,
``timeout_s``, ``lookup_timeout_s``, ``tag``, ...). Keys are LMCache's own key strings
(``<model>@<kv_rank>@<group>@<chunk_hash>[@salt]``) under the prefix ``<tag>-lmcache-l2_``; each object holds
a chunk's bytes as LMCache's memory object has them. Every batch is one pool call (puts: exists, then the
missing ones) on a worker thread, so submits never block LMCache; a failed or timed-out call completes
with ``ok`` False and per-key False, never raises into LMCache. Linux only (``os.eventfd``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool.client.connectors.base import PoolConnector, namespace_tag
from kvpool.common.log import get_logger

log = get_logger(__name__)

Completion = tuple[int, bool, str, list[bool] | None]
"""(future id, every key succeeded, error text, per-key results) as NativeConnectorL2Adapter reads it."""


class KvPoolL2Client:
    """kvpool as a ``native_plugin`` connector of LMCache's multi-process mode (see the module docstring)."""

    def __init__(self, **adapter_params: Any) -> None:
        self._side = PoolConnector(adapter_params)
        self._side.engine = "LMCache L2"
        self.pool = self._side.pool
        self.prefix = namespace_tag(self._side.settings.tag, "lmcache-l2") + "_"
        self._event_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._completions: list[Completion] = []
        self._next_id = 1
        self._closed = False
        # two workers: a lookup need not wait behind a large store
        self._workers = ThreadPoolExecutor(2, thread_name_prefix="kvpool-lmcache-l2")
        log.info("kvpool LMCache L2 client: master %s, prefix %r", self.pool.config.master, self.prefix)

    # --- the native connector interface ------------------------------------------------------------

    def event_fd(self) -> int:
        return self._event_fd

    def submit_batch_get(self, keys: Sequence[str], memoryviews: Sequence[memoryview]) -> int:
        views = [memoryview(v).cast("B") for v in memoryviews]
        return self._submit(lambda: self._get(list(keys), views))

    def submit_batch_set(self, keys: Sequence[str], memoryviews: Sequence[memoryview]) -> int:
        views = [memoryview(v).cast("B") for v in memoryviews]
        return self._submit(lambda: self._set(list(keys), views))

    def submit_batch_exists(self, keys: Sequence[str]) -> int:
        # a lookup succeeds with per-key answers even when some keys are missing: the adapter reads
        # the bits only of a call that is ok
        return self._submit(lambda: self._exists(list(keys)), ok_if_all=False)

    def submit_batch_delete(self, keys: Sequence[str]) -> int:
        return self._submit(lambda: self._delete(list(keys)))

    def drain_completions(self) -> list[Completion]:
        try:
            os.eventfd_read(self._event_fd)
        except BlockingIOError:  # nothing signalled since the last drain
            pass
        with self._lock:
            done, self._completions = self._completions, []
        return done

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._workers.shutdown(wait=True)  # every pool call has a deadline: this ends
        self._side.close()
        os.close(self._event_fd)

    # --- the pool calls ----------------------------------------------------------------------------

    def _keys(self, keys: list[str]) -> list[str]:
        return [self.prefix + key for key in keys]

    def _submit(self, work: Callable[[], list[bool]], ok_if_all: bool = True) -> int:
        with self._lock:
            if self._closed:
                raise RuntimeError("kvpool LMCache L2 client is closed")
            future_id = self._next_id
            self._next_id += 1
        self._workers.submit(self._run, future_id, work, ok_if_all)
        return future_id

    def _run(self, future_id: int, work: Callable[[], list[bool]], ok_if_all: bool) -> None:
        """Run one batch; ``ok`` is whether every key succeeded (``ok_if_all``) or whether the call did."""
        try:
            results = work()
            completion: Completion = (future_id, all(results) if ok_if_all else True, "", results)
        except Exception as exc:  # a failed batch completes as failed; LMCache never sees the exception
            log.warning("kvpool LMCache L2 client: batch %d failed: %s", future_id, exc)
            completion = (future_id, False, str(exc), None)
        with self._lock:
            self._completions.append(completion)
        os.eventfd_write(self._event_fd, 1)

    def _get(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        """Per key: was the whole view filled? (an object of another size is a miss, not a short read)"""
        codes = self.pool.batch_get_into(self._keys(keys), views, timeout=self._side.settings.timeout_s)
        return [code == len(view) for code, view in zip(codes, views, strict=True)]

    def _set(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        pool_keys = self._keys(keys)
        exists = self.pool.batch_exists(pool_keys, timeout=self._side.settings.lookup_timeout_s)
        written = [e == 1 for e in exists]  # values are immutable: present counts as written
        missing = [i for i, e in enumerate(exists) if e != 1]
        if missing:
            codes = self.pool.batch_put_from(
                [pool_keys[i] for i in missing], [views[i] for i in missing], timeout=self._side.settings.timeout_s
            )
            for i, code in zip(missing, codes, strict=True):
                written[i] = code == 0
        return written

    def _exists(self, keys: list[str]) -> list[bool]:
        found = self.pool.batch_exists(self._keys(keys), timeout=self._side.settings.lookup_timeout_s)
        return [e == 1 for e in found]

    def _delete(self, keys: list[str]) -> list[bool]:
        codes = self.pool.batch_remove(self._keys(keys), timeout=self._side.settings.timeout_s)
        return [code == 0 for code in codes]
